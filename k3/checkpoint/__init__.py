"""Checkpoint formats, shared by training, serving and quantization (none of which this imports).

- official.py: the HF layout with the official tensor names (config.json + safetensors shards + index);
  `load_pretrained` / `save_pretrained`.
- pretrained.py: `K3ForCausalLM` with those two as `from_pretrained` / `save_pretrained` (`k3.K3ForCausalLM`).
- packed.py: the official compressed-tensors `mxfp4-pack-quantized` layout of the routed experts.
- run_folder.py: a `k3 train` run folder and its `checkpoints/step_*` folders.
- training_state.py: our training checkpoint (the model in the official layout + optimizer, RNG and
  trainer state), for exact `--resume`.
- quantize_cli.py / quantize_report.py: `k3 quantize` and its per-layer error report.
"""
