"""Greedy held-out accuracy of post-trained runs on one domain, per effort and per kind of problem:
the figures `k3 rl` and `k3 distill` report, at more prompts than a run evaluates on its own.

    python -m k3.rl.evaluate runs/F runs/strings-max runs/M --domain strings --heldout 512

Each run (a `k3 sft`, `k3 rl` or `k3 distill` folder: its latest checkpoint and its tokenizer)
answers the domain's first `--heldout` held-out problems at each of `--efforts`, greedily, as the
trainers evaluate (`run_episodes`, the same `--max-tokens` default). One line per (run, effort):
accuracy, mean T(y) (think tokens; all generated tokens on agentic domains, DESIGN §13.2), and the
accuracy of each kind of problem (`Task.kind`). The held-out set is a prefix of the held-out stream,
so a run's own 128 prompts are the first 128 of 512. Levels of effort differ by a few points on
k3-tiny, where 128 prompts cannot order them (docs/LOG.md "A second SFT stage").
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from k3.checkpoint.run_folder import resolve_checkpoint
from k3.rl.cold_start import parse_efforts
from k3.tasks.domains import DOMAIN_CLASSES, make_domain
from k3.threads import ThreadsError, configure


def evaluate(model, xtml, tasks, effort: str, max_tokens: int) -> dict:
    """Greedy episodes of `tasks` at `effort`: accuracy, mean T(y), and [correct, count] per kind."""
    from k3.rl.effort import episode_length
    from k3.tasks.episodes import run_episodes

    episodes = run_episodes(model, xtml, tasks, effort, max_tokens, measure=episode_length(xtml))
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in episodes:
        kinds[e.task.kind][0] += int(e.score.correct)
        kinds[e.task.kind][1] += 1
    n = max(len(episodes), 1)
    return {"effort": effort, "episodes": len(episodes),
            "accuracy": sum(e.score.correct for e in episodes) / n,
            "mean_length": sum(e.length for e in episodes) / n,
            "kinds": dict(sorted(kinds.items()))}


def load_run(run: str | Path):
    """A run folder's latest checkpoint (or a checkpoint folder) as a model, and its XTML renderer
    (ValueError if there is no checkpoint, or it is no chat model)."""
    from k3.checkpoint.files import CheckpointError
    from k3.checkpoint.pretrained import load_pretrained
    from k3.text.tokenizer import load_tokenizer
    from k3.text.xtml import XTML

    try:
        ckpt = resolve_checkpoint(run)
        model, tokenizer = load_pretrained(ckpt), load_tokenizer(ckpt)
    except (FileNotFoundError, CheckpointError) as e:
        raise ValueError(f"{run}: {e}") from None
    return model, XTML(tokenizer)


def line(run: str, r: dict) -> str:
    kinds = ", ".join(f"{k} {c}/{n}" for k, (c, n) in r["kinds"].items())
    return (f"{run} {r['effort']}: accuracy {100 * r['accuracy']:.1f}% of {r['episodes']}, "
            f"mean T(y) {r['mean_length']:.2f} ({kinds})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3.rl.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="`k3 sft`, `k3 rl` or `k3 distill` run folders")
    ap.add_argument("--domain", required=True, choices=sorted(DOMAIN_CLASSES))
    ap.add_argument("--efforts", default="max,high,low", help="effort levels to answer at (default %(default)s)")
    ap.add_argument("--heldout", type=int, default=512, help="held-out prompts (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, help="per assistant turn (default: `k3 rl`'s)")
    ap.add_argument("--out", help="also write the results here as JSONL, a line per (run, effort)")
    ap.add_argument("--threads", metavar="N", help="CPU threads for torch (default: the CPUs available less one)")
    args = ap.parse_args(argv)
    try:
        efforts = parse_efforts(args.efforts)
        if args.heldout < 1 or (args.max_tokens is not None and args.max_tokens < 1):
            raise ValueError("--heldout and --max-tokens must be >= 1")
        checkpoints, missing = [], []
        for r in args.runs:
            try:
                checkpoints.append(resolve_checkpoint(r))
            except FileNotFoundError:
                missing.append(r)
        if missing:
            raise ValueError(f"not a run folder with checkpoints: {', '.join(missing)}")
        configure(args.threads)
        tasks = make_domain(args.domain).heldout(args.heldout)
    except (ValueError, ThreadsError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    from k3.rl.trainer import RLSettings  # after configure: it imports torch

    max_tokens = RLSettings.max_tokens if args.max_tokens is None else args.max_tokens
    rows = []
    for run, ckpt in zip(args.runs, checkpoints):
        try:
            model, xtml = load_run(ckpt)
        except ValueError as e:
            print(f"evaluate: error: {e}", file=sys.stderr)
            return 2
        for effort in efforts:
            r = evaluate(model, xtml, tasks, effort, max_tokens)
            print(line(run, r), flush=True)
            rows.append({"run": run, "domain": args.domain, **r})
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
