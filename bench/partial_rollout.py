"""Partial rollout (DESIGN §13.2): wall time per RL iteration with stop fraction 1 (synchronous) and
lower, on the long-tailed arithmetic mix (docs/BENCHMARKS.md "RL").

    python -m bench.partial_rollout --run SFT_RUN [--fractions 1.0,0.5] [--iterations 6]
                                    [--prompts 8] [--samples 8] [--max-tokens 192] [--json OUT]

For each stop fraction, a fresh `k3 rl` trainer (k3/rl/trainer.py) from the same SFT checkpoint runs
`iterations` iterations on `k3.tasks.domains.LONG_TAIL` arithmetic (most problems one or two steps, a
few a dozen), each a rollout plus an optimizer step. Reported per fraction: the median and mean
seconds per iteration after the first (the first has nothing paused to resume), trajectories
finished per iteration, sampled tokens per second, and the check that every trajectory created is
either trained exactly once or still paused at the end (none lost, none duplicated). The
fractions' runs alternate iteration by iteration, so a busy machine slows them alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from k3.rl.trainer import RLSettings, RLTrainer
from k3.tasks.domains import LONG_TAIL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a `k3 sft` run (or checkpoint) to start from")
    ap.add_argument("--fractions", default="1.0,0.5")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    fractions = [float(x) for x in args.fractions.split(",")]
    budgets = None
    trainers, times, trained_uids = {}, {f: [] for f in fractions}, {f: Counter() for f in fractions}
    with tempfile.TemporaryDirectory() as tmp:
        for f in fractions:
            s = RLSettings(init=args.run, out=f"{tmp}/lam{f}", domain="arithmetic", domain_options=dict(LONG_TAIL),
                           steps=args.iterations, prompts=args.prompts, samples=args.samples, stop_fraction=f,
                           max_tokens=args.max_tokens, pool=64, heldout=1, budget_samples=1, budgets=budgets,
                           ckpt_every=10 ** 6, eval_every=10 ** 6, seed=args.seed)
            trainers[f] = RLTrainer(s, progress=False, log=lambda *a, **k: None)
            budgets = str(Path(tmp) / f"lam{f}" / "budgets.json")  # measured once, shared
        records = {f: [] for f in fractions}
        for f, tr in trainers.items():  # count what each optimizer step trains on
            def counted(trained, advantages, f=f, original=tr.optimize):
                trained_uids[f].update(t.uid for t in trained)
                return original(trained, advantages)

            tr.optimize = counted
        for _ in range(args.iterations):
            for f, tr in trainers.items():
                t0 = time.perf_counter()
                records[f].append(tr.train_step())
                times[f].append(time.perf_counter() - t0)
        out = {"iterations": args.iterations, "prompts": args.prompts, "samples": args.samples,
               "max_tokens": args.max_tokens, "domain_options": LONG_TAIL, "fractions": {}}
        for f, tr in trainers.items():
            later = times[f][1:]
            created = sum(r["new"] for r in records[f])
            paused = {t.uid for t in tr.unfinished}
            dup = [u for u, c in trained_uids[f].items() if c > 1]
            out["fractions"][str(f)] = {
                "median_s": statistics.median(later), "mean_s": statistics.mean(later),
                "seconds": [round(x, 2) for x in times[f]], "rollout_s": [r["rollout_s"] for r in records[f]],
                "finished_per_iteration": statistics.mean(r["episodes"] for r in records[f]),
                "sampled_tokens_per_s": sum(r["step_tokens"] - r["trained_tokens"] for r in records[f]) / sum(times[f]),
                "created": created, "trained": len(trained_uids[f]), "paused_at_end": len(paused),
                "lost": created - len(trained_uids[f]) - len(paused - set(trained_uids[f])), "duplicated": len(dup),
                "max_staleness": max(r.get("staleness", 0.0) for r in records[f])}
            tr.close()
    base = out["fractions"][str(fractions[0])]["median_s"]
    for f in fractions:
        r = out["fractions"][str(f)]
        r["speedup"] = base / r["median_s"]
        print(f"stop fraction {f}: {r['median_s']:.2f} s/iteration median ({r['mean_s']:.2f} mean), "
              f"{r['finished_per_iteration']:.1f} finished/iteration, x{r['speedup']:.2f}; "
              f"created {r['created']}, trained {r['trained']}, paused {r['paused_at_end']}, lost {r['lost']}, "
              f"duplicated {r['duplicated']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
