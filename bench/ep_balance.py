"""How balanced are expert-parallel ranks: no replication vs static EPLB vs the online plan.

`python -m bench.ep_balance` prints, on K3's geometry (896 experts, top-16, S tokens per rank)
over 64/128/256 simulated ranks, the max/mean rank load (pairs a rank runs / S*K) of
  - none:   each expert only on its home rank;
  - EPLB:   DeepSeek-V3's static heuristic given the slots the online plan may use (2 ceil(E/R)
            per rank), planned from the previous batch's loads: a fresh sample of the same router
            distribution (its best case), and after the popularity drifted (a tenth of the experts
            swap ranks with others: what a static plan sees between re-plans);
  - online: k3/parallel/ep_plan.plan_balanced on the batch's own loads (DESIGN §14.2);
and the planning time per layer of each (median over batches; host, one core).
`python -m bench.ep_balance --record RUN --out FILE` records per-micro-batch, per-layer expert
loads of a trained run's checkpoint (the fixture tests/parallel/tiny_run_loads.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from k3.parallel.ep_plan import home_ranks, plan_balanced, plan_static
from k3.parallel.eplb import eplb_replicas

E, K = 896, 16


def _load(weights: torch.Tensor, tokens: int, seed: int) -> torch.Tensor:
    """K distinct experts per token drawn by `weights` (Gumbel top-k, in chunks of 8192 tokens)."""
    g = torch.Generator().manual_seed(seed)
    logw, load = weights.float().log(), torch.zeros(E, dtype=torch.long)
    for start in range(0, tokens, 8192):
        n = min(8192, tokens - start)
        gumbel = -torch.empty(n, E).exponential_(generator=g).log()
        load += torch.bincount(torch.topk(logw + gumbel, K, dim=-1).indices.flatten(), minlength=E)
    return load


def _drifted(w: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    a, b = torch.randperm(E, generator=g)[: 2 * (E // 10)].chunk(2)
    out = w.clone()
    out[a], out[b] = w[b], w[a]
    return out


def _weights(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if name == "uniform":
        return torch.ones(E)
    if name.startswith("zipf"):
        s = float(name[4:])
        return (1.0 / torch.arange(1, E + 1).double() ** s)[torch.randperm(E, generator=g)]
    w = torch.full((E,), 1e-9)  # one-expert: every token's first choice is the same expert
    w[3] = 1e9
    return w


def table(S: int, batches: int) -> None:
    print("| router output | R | none max/mean | EPLB max/mean | EPLB after drift | online max/mean "
          "| online guests (bound) | EPLB plan ms | online plan ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("uniform", "zipf0.5", "zipf1", "zipf1.5", "one-expert"):
        w = _weights(name)
        for R in (64, 128, 256):
            m = math.ceil(E / R)
            loads = [_load(w, R * S, seed) for seed in range(batches + 1)]
            drift = _load(_drifted(w), R * S, batches + 1)
            none, eplb, drifted, online, guests, t_eplb, t_online = [], [], [], [], [], [], []
            for prev, cur in itertools.pairwise(loads):
                mean = int(cur.sum()) / R
                none.append(float(plan_static(cur, R, home_ranks(E, R)).rank_load().max()) / mean)
                t0 = time.perf_counter()
                replicas = eplb_replicas(prev, R, redundant=2 * m * R - E)  # 2m slots per rank, as online
                t_eplb.append(time.perf_counter() - t0)
                eplb.append(float(plan_static(cur, R, replicas).rank_load().max()) / mean)
                drifted.append(float(plan_static(drift, R, replicas).rank_load().max()) / (int(drift.sum()) / R))
                t0 = time.perf_counter()
                plan = plan_balanced(cur, R)
                t_online.append(time.perf_counter() - t0)
                online.append(float(plan.rank_load().max()) / mean)
                guests.append(plan.max_guests())
            print(f"| {name} | {R} | {max(none):.2f} | {max(eplb):.2f} | {max(drifted):.2f} | {max(online):.2f} "
                  f"| {max(guests)} ({m}) "
                  f"| {statistics.median(t_eplb) * 1e3:.0f} | {statistics.median(t_online) * 1e3:.1f} |")


@torch.no_grad()
def record(run: str, out: str, batches: int, tokens: int) -> None:
    """Per-layer expert loads of `batches` micro-batches of `tokens` training tokens each."""
    from k3 import K3ForCausalLM
    from k3.data.corpus import load_documents
    from k3.model.moe import MoEGate
    from k3.text.tokenizer import load_tokenizer

    model = K3ForCausalLM.from_pretrained(run).eval()
    tok = load_tokenizer(Path(run))
    text = "".join(d.text for d in load_documents()[:4])
    ids = torch.tensor(tok.encode(text).ids[: batches * tokens]).view(batches, tokens)
    loads: list[list[int]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: loads.append(
        torch.bincount(out[1].flatten(), minlength=model.config.num_experts).tolist()))
        for m in model.modules() if isinstance(m, MoEGate)]
    for row in ids:
        model(row[None])
    for h in hooks:
        h.remove()
    Path(out).write_text(json.dumps({"source": f"{Path(run).name}: {batches} micro-batches x {tokens} tokens, "
                                               f"{len(hooks)} MoE layers, top-{model.config.num_experts_per_token}",
                                     "loads": loads}) + "\n")
    print(f"{len(loads)} loads -> {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens-per-rank", type=int, default=512)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--record", metavar="RUN")
    p.add_argument("--out")
    args = p.parse_args()
    if args.record:
        record(args.record, args.out, args.batches, args.tokens_per_rank)
    else:
        table(args.tokens_per_rank, args.batches)


if __name__ == "__main__":
    main()
