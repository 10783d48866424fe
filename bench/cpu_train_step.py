"""Seconds per default `k3 train` step on this CPU (k3-tiny, bundled corpus, 8 x 256 tokens).

    python -m bench.cpu_train_step [--threads 1] [--steps 12]

Times `Trainer.train_step` alone (no evals, checkpoints or samples) in a temporary run folder and
prints the median of the steps after the first two (allocator warm-up) with each step's time.
Thread count and wait policy as `k3` picks them (k3/threads.py) unless `--threads` is given;
`OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment still apply.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from k3.threads import configure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    print(configure(args.threads).describe())
    from k3.train.trainer import Trainer, TrainSettings  # after configure: torch reads the thread settings

    with tempfile.TemporaryDirectory() as tmp:
        s = TrainSettings(steps=args.steps, out=str(Path(tmp) / "run"), eval_every=10**6, ckpt_every=10**6,
                          sample_tokens=0)
        trainer = Trainer(s, progress=False, log=lambda *a: None)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        trainer.close()
    kept = times[2:] or times
    print(f"median {statistics.median(kept):.3f} s/step over steps 3-{len(times)}: "
          + " ".join(f"{t:.2f}" for t in kept))


if __name__ == "__main__":
    main()
