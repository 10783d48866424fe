"""Where our KDA layer's fwd+bwd time goes against fla's own layer, kernel by kernel (the target:
our layer at least as fast as fla's).

    python -m bench.kda_layer_profile [--tokens 65536] [--steps 3]

Both layers as bench.gpu_bench's kda bench builds them (k3-1b heads and dims, bf16 weights and
input, batch 1, K3's bounded gate); each is warmed up, then a few fwd+bwd steps run under
torch.profiler. Prints each layer's kernel tables and aten-op table, then a short table last: GPU
time per step by kind of kernel, side by side. CUDA with fla only.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_bench import fla_kda_layer, layer_fwd_bwd
from bench.kernel_profile import print_kernel_tables, print_op_table
from k3.config import load_config
from k3.model.kda import KimiDeltaAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_layer_profile: error: needs CUDA and fla-core with triton")
    device, bf16 = torch.device("cuda"), torch.bfloat16
    cfg = load_config("k3-1b")
    layers = {"k3": KimiDeltaAttention(cfg, 0), "fla": fla_kda_layer(cfg)}
    kinds: dict[str, dict[str, float]] = {}
    wall: dict[str, float] = {}
    for name, layer in layers.items():
        x = torch.randn(1, args.tokens, cfg.hidden_size, device=device, dtype=bf16, requires_grad=True)
        pick = (lambda y: y) if name == "k3" else (lambda y: y[0])
        step = layer_fwd_bwd(layer.to(device, bf16), x, pick)
        for _ in range(3):  # compiles and autotunes fla's kernels for this length
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            start.record()
            for _ in range(args.steps):
                step()
            end.record()
            torch.cuda.synchronize()
        wall[name] = start.elapsed_time(end) / args.steps
        kinds[name] = print_kernel_tables(prof, args.steps, f"{name} layer, T {args.tokens}, fwd+bwd", top=25)
        print(f"\n{name} layer's aten ops:")
        print_op_table(prof, args.steps, top=20)
        del step, x
        layer.cpu()
        torch.cuda.empty_cache()
    print(f"\n### KDA layer fwd+bwd, T {args.tokens}: GPU ms per step by kind (profiled)")
    print("| kind | k3 | fla |\n|---|---|---|")
    for kind in sorted(set(kinds["k3"]) | set(kinds["fla"]), key=lambda k: -kinds["k3"].get(k, 0.0)):
        print(f"| {kind} | {kinds['k3'].get(kind, 0.0):.3f} | {kinds['fla'].get(kind, 0.0):.3f} |")
    print(f"| kernels, all | {sum(kinds['k3'].values()):.3f} | {sum(kinds['fla'].values()):.3f} |")
    print(f"| wall (events, under the profiler) | {wall['k3']:.3f} | {wall['fla']:.3f} |")


if __name__ == "__main__":
    main()
