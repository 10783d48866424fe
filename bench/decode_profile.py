"""Where a decode step's time goes: torch.profiler over a few k3-1b decode steps on one GPU.

    python -m bench.decode_profile [--batch 1] [--context 1024] [--variant hybrid|all-MLA]
                                     [--modes eager,graph,graph+compile]

Profiles eager steps (host launch overhead visible as the gap between CPU and CUDA totals),
CUDA-graph replays (GPU time only) and replays of the model with its regions compiled
(k3.regional_compile, as bench.gpu_bench's "graph+compile" rows), and prints the kernels
by CUDA time, a short table last. CUDA only.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_bench import all_mla, decode_step, random_cache
from bench.kernel_profile import print_kernel_tables
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.regional_compile import compile_regions

MODES = ("eager", "graph", "graph+compile")  # in this order: the last compiles the model in place


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variant", choices=("hybrid", "all-MLA"), default="hybrid")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile: error: needs CUDA")
    device = torch.device("cuda")
    cfg = load_config("k3-1b").replace(mla_impl="absorb")
    cfg = all_mla(cfg) if args.variant == "all-MLA" else cfg
    with torch.device(device):
        model = K3ForCausalLM(cfg).to(torch.bfloat16).eval()
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, 1), device=device)
    asked = set(args.modes.split(","))
    if asked - set(MODES):
        ap.error(f"--modes: unknown {sorted(asked - set(MODES))}; choose from {', '.join(MODES)}")
    for mode in [m for m in MODES if m in asked]:
        if mode == "graph+compile":
            compile_regions(model)  # in place: it is the last mode
        cache = random_cache(cfg, args.batch, args.context, device, torch.bfloat16,
                             capacity=args.context + 4 * args.steps)
        step = decode_step(model, cache, graphed=mode != "eager")
        for _ in range(2):
            tokens.copy_(step(tokens).argmax(-1, keepdim=True))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                tokens.copy_(step(tokens).argmax(-1, keepdim=True))
            torch.cuda.synchronize()
        print_kernel_tables(prof, args.steps, f"{mode}: {args.variant} B{args.batch} ctx{args.context}")


if __name__ == "__main__":
    main()
