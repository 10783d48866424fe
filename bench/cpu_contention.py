"""Does k3 keep its speed on a CPU shared with one busy process? (k3/threads.py's thread rule)

    python -m bench.cpu_contention [--steps 8] [--reply-tokens 256] [--threads N]

In one run: the default `k3 train` (k3-tiny, bundled corpus) for `--steps` steps alone, then beside
one busy competing process (`python -c "while True: pass"`); the same for one greedy reply of
`--reply-tokens` tokens from `k3.serve.engine.LLMEngine` on a randomly initialized k3-tiny. Each
measurement is a fresh subprocess, so it picks its threads exactly as `k3` does (pass `--threads`
to try another count; `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment reach it too).
Training time is the mean of the steps after the first (which warms up allocators); the reply
time follows one short warm-up reply. The table comes last: quiet, contended, their ratio, and
whether the ratio is within the bar (<= 2x).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAR = 2.0
BUSY = "while True: pass"


def _busy():
    return subprocess.Popen([sys.executable, "-c", BUSY])


def train_seconds_per_step(steps: int, threads: str | None, out: Path) -> float:
    cmd = [sys.executable, "-m", "k3", *(["--threads", threads] if threads else []), "train", "--steps", str(steps),
           "--out", str(out), "--no-progress", "--eval-every", str(steps + 1), "--ckpt-every", str(steps + 1),
           "--eval-windows", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench.cpu_contention: `{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["tokens"] / r["step"] / r["tok_per_s"] for r in train[1:]] or [train[0]["elapsed"]]
    return sum(times) / len(times)


def reply_seconds(tokens: int, threads: str | None) -> float:
    cmd = [sys.executable, "-m", "bench.cpu_contention", "--reply-worker", "--reply-tokens", str(tokens),
           *(["--threads", threads] if threads else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench.cpu_contention: the reply worker failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _reply_worker(tokens: int, threads: str | None) -> None:
    """One greedy reply on a random k3-tiny through the serving engine; prints its seconds."""
    from k3.threads import configure

    print(configure(threads).describe(), file=sys.stderr)  # before torch loads, as `k3` does
    import torch

    from k3.config import load_config
    from k3.model.transformer import K3ForCausalLM
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    engine = LLMEngine(model, EngineConfig(cuda_graphs=False))
    prompt = torch.randint(0, model.config.vocab_size, (32,)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - start
    assert len(out[0]) == tokens, len(out[0])
    print(f"{elapsed:.3f}")


def _measure(fn):
    quiet = fn()
    busy = _busy()
    try:
        time.sleep(0.5)  # let the competitor get scheduled
        contended = fn()
    finally:
        busy.kill()
        busy.wait()
    return quiet, contended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per measurement (default 8)")
    ap.add_argument("--reply-tokens", type=int, default=256, help="tokens in the timed reply (default 256)")
    ap.add_argument("--threads", help="passed to `k3 --threads` (default: k3's own choice)")
    ap.add_argument("--reply-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reply_worker:
        _reply_worker(args.reply_tokens, args.threads)
        return
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1_000))
        train = _measure(lambda: train_seconds_per_step(args.steps, args.threads, Path(tmp) / f"run{next(runs)}"))
    reply = _measure(lambda: reply_seconds(args.reply_tokens, args.threads))
    rows = [(f"k3 train, s/step ({args.steps} steps)", *train), (f"{args.reply_tokens}-token reply, s", *reply)]
    print(f"\nthreads: {args.threads or 'k3 default'}; competitor: one `python -c \"{BUSY}\"`")
    print(f"{'':32} {'quiet':>8} {'contended':>10} {'ratio':>6}  bar (<= {BAR:g}x)")
    for name, quiet, contended in rows:
        ratio = contended / quiet
        print(f"{name:32} {quiet:8.2f} {contended:10.2f} {ratio:6.2f}  {'ok' if ratio <= BAR else 'OVER'}")


if __name__ == "__main__":
    main()
