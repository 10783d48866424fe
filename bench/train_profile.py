"""Where a training step's time goes: torch.profiler over k3-1b training steps on one GPU.

    python -m bench.train_profile [--batch 8] [--seq 4096] [--steps 2] [--compile]

The step is the one bench.gpu_bench times (bf16 autocast over fp32 weights, fused AdamW). Prints
the aten ops (with input shapes) and kernels that take the most GPU time, then the GPU time by
kind of kernel, a short table last. CUDA only.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_bench import training_step
from bench.kernel_profile import print_kernel_tables, print_op_table
from k3.config import load_config
from k3.regional_compile import compile_regions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="regional torch.compile, as `k3 train --compile`")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_profile: error: needs CUDA")
    device = torch.device("cuda")
    cfg = load_config("k3-1b")
    model, _, step = training_step(cfg, device)
    if args.compile:
        compile_regions(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device)
    for _ in range(3 if args.compile else 2):  # kernel compiles, autotuning and torch.compile out of the profile
        step(ids)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(args.steps):
            step(ids)
        torch.cuda.synchronize()
    wall_ms = (time.monotonic() - t0) * 1e3 / args.steps
    print(f"\nk3-1b B{args.batch} T{args.seq}{' compiled' if args.compile else ''}: {wall_ms:.1f} ms/step wall (profiled)")
    print_op_table(prof, args.steps)
    print_kernel_tables(prof, args.steps, f"k3-1b training step, B{args.batch} T{args.seq}", top=16)


if __name__ == "__main__":
    main()
