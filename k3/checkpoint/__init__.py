"""Checkpoint formats, shared by training, serving and quantization (none of which this imports).

- files.py: an HF-layout folder's files (config.json, safetensors shards, the index) read safely.
- official.py: the official tensor names (one prefix, experts split per file) and `save_pretrained`.
- pretrained.py: `load_pretrained`, the one loader (plain, official, MXFP4-packed, Kimi-Linear
  folders), registered with the writer as `K3ForCausalLM.from_pretrained` / `save_pretrained`.
  Imports run one way: files <- official <- packed <- pretrained.
- packed.py: the official compressed-tensors `mxfp4-pack-quantized` layout of the routed experts.
- run_folder.py: a `k3 train` run folder and its `checkpoints/step_*` folders.
- training_state.py: our training checkpoint (the model in the official layout + optimizer, RNG and
  trainer state), for exact `--resume`.
- quantize_cli.py / quantize_report.py: `k3 quantize` and its per-layer error report.
"""
