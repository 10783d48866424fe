"""The one-GPU tool-use pipeline, timed and scored: pretraining on the copying mix, then SFT, per
seed, as a user runs them (`python -m k3 train` / `python -m k3 sft` as subprocesses).

    python -m bench.gpu_pipeline [--device cuda] [--seeds 0 1 2] [--train-steps 1000] [--sft-steps 700]
        [--sft-batch-size N] [--precision bf16|fp32]

Prints each seed's wall time per stage and its held-out agent scores (valid XTML, right tool with
right arguments and right final answer on tool prompts, over `--episodes` held-out episodes), then
mean +- std over seeds, the table last. The bars: docs/BENCHMARKS.md "Post-training".
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCORES = ("valid_xtml", "tool_prompts_tool_ok", "tool_prompts_answer_correct")


def run_stage(args: list[str]) -> float:
    """Run `python -m k3 ARGS`; its wall time in seconds (SystemExit with its output if it fails)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "k3", *args, "--no-progress"], check=False, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"gpu_pipeline: error: k3 {' '.join(args)} exited {done.returncode}:\n"
                         + (done.stdout + done.stderr)[-3000:])
    return time.perf_counter() - t0


def agent_scores(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    agent = [r for r in records if r["kind"] == "agent"]
    if not agent:
        raise SystemExit(f"gpu_pipeline: error: {run_dir} has no agent record")
    return agent[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-steps", type=int, default=1000)
    ap.add_argument("--copy-share", type=float, default=0.4)
    ap.add_argument("--sft-steps", type=int, default=700)
    ap.add_argument("--train-size", type=int, default=5600)
    ap.add_argument("--episodes", type=int, default=256, help="held-out agent episodes (and held-out conversations)")
    ap.add_argument("--sft-batch-size", type=int, default=None, help="conversations per SFT step (default: k3 sft's)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="both stages' CUDA compute")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for seed in args.seeds:
            base, sft = root / f"base-{seed}", root / f"sft-{seed}"
            t_train = run_stage(["train", "--device", args.device, "--seed", str(seed), "--out", str(base),
                                 "--steps", str(args.train_steps), "--copy-share", str(args.copy_share),
                                 "--precision", args.precision])
            t_sft = run_stage(["sft", "--run", str(base), "--device", args.device, "--seed", str(seed),
                               "--out", str(sft), "--steps", str(args.sft_steps), "--train-size", str(args.train_size),
                               "--val-size", str(args.episodes), "--agent-episodes", str(args.episodes),
                               "--precision", args.precision,
                               *(["--batch-size", str(args.sft_batch_size)] if args.sft_batch_size else [])])
            scores = agent_scores(sft)
            rows.append({"seed": seed, "train_s": t_train, "sft_s": t_sft, **{k: scores.get(k) for k in SCORES},
                         "episodes": scores.get("episodes")})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| seed | train s | sft s | total min | " + " | ".join(SCORES) + " | episodes |")
    print("|---|---|---|---|" + "---|" * (len(SCORES) + 1))
    for r in rows:
        print(f"| {r['seed']} | {r['train_s']:.0f} | {r['sft_s']:.0f} | {(r['train_s'] + r['sft_s']) / 60:.1f} | "
              + " | ".join(f"{r[k]:.1%}" if r[k] is not None else "-" for k in SCORES) + f" | {r['episodes']} |")
    if len(rows) > 1:
        def mean_std(key):
            values = [r[key] for r in rows if r[key] is not None]
            return f"{statistics.mean(values):.1%} +- {statistics.stdev(values):.1%}" if len(values) > 1 else "-"
        total = [(r["train_s"] + r["sft_s"]) / 60 for r in rows]
        print(f"| mean | | | {statistics.mean(total):.1f} | " + " | ".join(mean_std(k) for k in SCORES) + " | |")


if __name__ == "__main__":
    main()
