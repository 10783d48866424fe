"""Decode throughput of the engine with and without fused input projections (k3/model/fusion.py),
in the same run, on the same random weights: `k3 serve` against `k3 serve --no-fuse-projections`.

    python -m bench.fused_projections [--config k3-tiny] [--device cpu|cuda] [--batch 8]
                                      [--prompt-len 32] [--new-tokens 64] [--repeats 3] [--threads 1]

Each run adds `--batch` greedy requests, steps until every prompt is prefilled, then times the
decode steps to the end: decode tokens/s = tokens sampled after the prefill / that time (median of
`--repeats` runs, the two engines alternating). Also counts the matrix products of one decode step
of the bare model (aten mm/addmm/bmm calls) and checks both engines sampled the same tokens. fp32
on CPU, bf16 on CUDA (the engine's CUDA graphs on by default there).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams

GEMMS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in GEMMS
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def gemms_per_decode_step(model, batch: int, device) -> int:
    cache = K3Cache.empty(model.config, batch, device=device, dtype=next(model.parameters()).dtype)
    model(torch.zeros(batch, 4, dtype=torch.long, device=device), cache=cache)
    with _CountGemms() as mode:
        model(torch.zeros(batch, 1, dtype=torch.long, device=device), cache=cache)
    return mode.count


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, device) -> tuple[float, list]:
    """(decode tokens/s after every prompt is prefilled, the sampled tokens)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    tokens = {rid: [] for rid in ids}

    def step() -> int:
        n = 0
        for o in engine.step():
            tokens[o.request_id] += [t.token_id for t in o.new_tokens]
            n += len(o.new_tokens)
        return n

    while any(not t for t in tokens.values()):
        step()
    _sync(device)
    start, decoded = time.perf_counter(), 0
    while engine.has_unfinished:
        decoded += step()
    _sync(device)
    return decoded / (time.perf_counter() - start), [tokens[rid] for rid in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="k3-tiny", help="a bundled config name (k3-tiny, k3-1b)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = load_config(args.config)
    with torch.device(device):
        base = K3ForCausalLM(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    budget = max(256, args.batch * args.prompt_len)
    engines = {}
    for fuse in (False, True):  # the fused engine takes the base model itself: one copy fewer in memory
        engines[fuse] = LLMEngine(base if fuse else copy.deepcopy(base), EngineConfig(
            max_num_seqs=args.batch, max_num_batched_tokens=budget, fuse_projections=fuse,
            max_model_len=args.prompt_len + args.new_tokens + 8, enable_prefix_caching=False))
    gemms = {fuse: gemms_per_decode_step(e.model, args.batch, device) for fuse, e in engines.items()}
    rates, outs = {False: [], True: []}, {}
    decode_rate(engines[False], prompts[:1], 4, device)  # warm-up (CUDA graphs captured on first use)
    decode_rate(engines[True], prompts[:1], 4, device)
    for _ in range(args.repeats):
        for fuse in (False, True):
            rate, outs[fuse] = decode_rate(engines[fuse], prompts, args.new_tokens, device)
            rates[fuse].append(rate)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"{args.config} on {name}, {dtype}: batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    for fuse in (False, True):
        print(f"  {'fused  ' if fuse else 'unfused'}  {statistics.median(rates[fuse]):9.1f} decode tok/s  "
              f"{gemms[fuse]:4d} GEMMs per decode step  (runs: {', '.join(f'{r:.1f}' for r in rates[fuse])})")
    print(f"  speedup {statistics.median(rates[True]) / statistics.median(rates[False]):.3f}x; "
          f"same greedy tokens: {outs[True] == outs[False]}")


if __name__ == "__main__":
    main()
