"""Where the serving engine's host time goes: the mixed workload of bench.serve, k3 engine only,
twice: a first round (kernels compile and autotune on new shapes), then a warm one; `--round`
picks the one run under cProfile.

    python -m bench.engine_host_profile [--size gpu --device cuda] [--round first|warm]

A warm packed forward on the GPU spends most of its wall time on the host, so what to shorten is
Python and launch work; torch.profiler sees aten ops and kernels, cProfile sees the Python
functions around them (ours and fla's). cProfile slows Python calls, so read the shares, not the
seconds. The first round is what a freshly started server pays (one-off work on new shapes: kernel
autotuning, attention plans); `--round first` shows where that goes. Prints the functions by
cumulative time, then a table of them by own time last.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile

import torch

from bench.serve import SIZES, bench_k3, kimi_linear, mixed_workload
from bench.serve_modes import steps_line
from k3.checkpoint.pretrained import load_pretrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--budget", type=int, default=32 * 512, help="max tokens per packed forward")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--round", choices=("first", "warm"), default="warm", help="the round to profile")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_host_profile: error: no CUDA device here; pass --device cpu (and --size tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as d:
        kimi_linear(args.vocab, args.size).save_pretrained(d)
        model = load_pretrained(d, device=device, dtype=dtype).eval()
    prompts, wants = mixed_workload(args.requests, (32, 512), (8, 128), args.vocab)
    graphs = device.type == "cuda"
    stats = None
    for label in ("first", "warm"):
        profiler = cProfile.Profile() if label == args.round else None
        if profiler:
            profiler.enable()
        _, elapsed, _, steps = bench_k3(model, prompts, wants, args.budget, args.concurrency, graphs)
        if profiler:
            profiler.disable()
            stats = pstats.Stats(profiler)
        print(f"{label} round{' (profiled)' if profiler else ''}: {elapsed:.2f} s; {steps_line(steps)}", flush=True)
    for key in ("cumulative", "tottime"):
        print(f"\n### by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
