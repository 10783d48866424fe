"""Where a decode step's time goes: torch.profiler over a few k3-1b decode steps on one GPU.

    python bench/decode_profile.py [--batch 1] [--context 1024] [--variant hybrid|all-MLA]

Profiles eager steps (host launch overhead visible as the gap between CPU and CUDA totals) and
CUDA-graph replays (GPU time only), and prints the kernels by total CUDA time, a short table last.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu_bench import all_mla, decode_step, random_cache  # noqa: E402
from k3.config import load_config  # noqa: E402
from k3.model.transformer import K3ForCausalLM  # noqa: E402


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variant", choices=("hybrid", "all-MLA"), default="hybrid")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = load_config("k3-1b").replace(mla_impl="absorb")
    cfg = all_mla(cfg) if args.variant == "all-MLA" else cfg
    with torch.device(device):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, 1), device=device)
    for mode in ("eager", "graph"):
        cache = random_cache(cfg, args.batch, args.context, device, torch.bfloat16,
                             capacity=args.context + 4 * args.steps)
        step = decode_step(model, cache, graphed=mode == "graph")
        for _ in range(2):
            tokens.copy_(step(tokens).argmax(-1, keepdim=True))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                tokens.copy_(step(tokens).argmax(-1, keepdim=True))
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: e.device_time_total, reverse=True)
        total_us = sum(e.self_device_time_total for e in events)
        print(f"\n### {mode}: {args.variant} B{args.batch} ctx{args.context}, {args.steps} steps, "
              f"CUDA self time {total_us / args.steps / 1e3:.3f} ms/step")
        print("| op / kernel | calls/step | CUDA ms/step (self) |")
        print("|---|---|---|")
        for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:14]:
            print(f"| {e.key[:90]} | {e.count / args.steps:.0f} | {e.self_device_time_total / args.steps / 1e3:.3f} |")


if __name__ == "__main__":
    main()
