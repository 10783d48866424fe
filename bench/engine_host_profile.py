"""Where the serving engine's host time goes: the mixed workload of bench/serve.py, k3 engine only,
twice: a first round (kernels compile and autotune on new shapes), then a warm one; `--round`
picks the one run under cProfile.

A warm packed forward on the GPU is host-bound (run 19: ~4 ms of kernels in ~26 ms of wall time),
so what to shorten is Python and launch work; torch.profiler sees aten ops and kernels, cProfile
sees the Python functions around them (ours and fla's). cProfile slows Python calls, so read the
shares, not the seconds. Prints the functions by cumulative time, then by own time.

    python3 bench/engine_host_profile.py --size gpu --device cuda [--round first]

The first round is what a freshly started server pays (run 25: 13.7 s against 5.4 s warm, 5.6 s of
it in one 8,294-token packed forward), so `--round first` shows where that goes (run 28: cuDNN's
SDPA plans, since avoided; docs/BENCHMARKS.md runs 28-29).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.serve import bench_k3, kimi_linear, mixed_workload  # noqa: E402
from bench.serve_modes import steps_line  # noqa: E402
from k3.checkpoint.official import load_pretrained  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="gpu")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--budget", type=int, default=32 * 512, help="max tokens per packed forward")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--round", choices=("first", "warm"), default="warm", help="the round to profile")
    args = ap.parse_args()
    device = torch.device(args.device)
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
