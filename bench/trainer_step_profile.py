"""Where a `k3 train` step's wall time goes on one GPU: the real Trainer (packed windows, bf16
autocast, Per-Head Muon, Quantile Balancing), timed phase by phase, then a torch.profiler count of
kernels per step.

    python -m bench.trainer_step_profile [--config k3-tiny] [--steps 12] [--graph]

Each phase (pack + copy, forward, backward, optimizer + balance) ends in a device synchronize, so
its time is what the host spends issuing it when the step is launch-bound. CUDA only.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.kernel_profile import print_kernel_tables
from k3.train.trainer import Trainer, TrainSettings


def phases(trainer: Trainer) -> dict[str, float]:
    """One eager step of `trainer`, phase by phase (ms)."""
    sync, out = torch.cuda.synchronize, {}
    t0 = time.perf_counter()
    items, targets = trainer.step_items()
    batch = trainer.pack_items(items).to(trainer.world.device)
    sync()
    t1 = time.perf_counter()
    trainer.model.train()
    loss = trainer._loss_sum(batch)
    sync()
    t2 = time.perf_counter()
    (loss / targets).backward()
    sync()
    t3 = time.perf_counter()
    trainer.optimizer_step()
    sync()
    t4 = time.perf_counter()
    out.update(pack=(t1 - t0) * 1e3, forward=(t2 - t1) * 1e3, backward=(t3 - t2) * 1e3, optimizer=(t4 - t3) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="k3-tiny")
    ap.add_argument("--steps", type=int, default=12, help="timed steps after 3 warm-up steps")
    ap.add_argument("--graph", action="store_true", help="the captured step (k3 train's default on CUDA): "
                    "no phases, the step's time and kernels only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("trainer_step_profile: error: needs CUDA")
    with tempfile.TemporaryDirectory() as out:
        s = dataclasses.replace(TrainSettings(), config=args.config, device="cuda", out=out, steps=10_000,
                                cuda_graphs=args.graph)
        trainer = Trainer(s, progress=False, log=lambda *a, **k: None)
        tokens = s.batch_size * s.seq_len
        if not args.graph:
            for _ in range(3):
                phases(trainer)
            rows = [phases(trainer) for _ in range(args.steps)]
            med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
            total = sum(med.values())
            print(f"{args.config}, {s.batch_size} x {s.seq_len} tokens: {total:.1f} ms/step with phase syncs "
                  f"({tokens / total * 1e3:,.0f} tok/s); median ms: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
        for _ in range(3):  # graphs: eager first step, capture
            trainer.train_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        print(f"train_step: {dt * 1e3:.1f} ms/step ({tokens / dt:,.0f} tok/s)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                trainer.train_step()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"kernels per step: {kernels / 2:,.0f}")
        print_kernel_tables(prof, 2, f"{args.config} k3 train step", top=12)
        trainer.close()


if __name__ == "__main__":
    main()
