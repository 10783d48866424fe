"""FSDP2 data parallel on CPU: `torchrun --nproc-per-node 2 -m k3 train` (gloo) matches one process
with the same global batch, and its (unsharded) checkpoint resumes in a single process.

Tolerance: relative 1e-5 per step's loss. The two runs differ only in summation order (each rank
sums its half of the batch; gradients are reduce-scattered), which moves fp32 losses by ~1e-7.
Both use `--balance histogram`: QB from margin histograms pooled over ranks (integer counts), the
same bias in both runs; exact QB would see only each rank's tokens.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from k3.train.trainer import Trainer, TrainSettings
from tests.helpers.train import REPO, losses, quiet, tiny_settings

REL_TOL = 1e-5


def test_two_process_fsdp_matches_one_process_and_resumes_single(tmp_path):
    settings = tiny_settings(tmp_path, "two", steps=4, ckpt_every=2, keep=3, eval_every=4, balance="histogram")
    argv = ["--config", settings.config, "--data", settings.data, "--out", settings.out, "--steps", "4",
            "--batch-size", str(settings.batch_size), "--seq-len", str(settings.seq_len), "--lr", str(settings.lr),
            "--eval-every", "4", "--ckpt-every", "2", "--keep", "3", "--balance", "histogram",
            "--cache-dir", settings.cache_dir, "--no-progress", "--keep-all-state"]  # resumed below from step 2
    # the 2-process run through the CLI; the single-process run then reads its run.json (same settings exactly)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "k3", "train", *argv], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = losses(settings.out)

    saved = json.loads((tmp_path / "two" / "run.json").read_text())
    single = TrainSettings(**{**saved, "out": str(tmp_path / "one"), "sample_prompts": tuple(saved["sample_prompts"])})
    Trainer(single, progress=False, log=quiet).train()
    one = losses(single.out)
    assert len(one) == len(two) == 4
    for step, (a, b) in enumerate(zip(one, two), 1):
        assert abs(a - b) / abs(a) <= REL_TOL, f"step {step}: 1 process {a}, 2 processes {b}"

    # resume the 2-process run at its step-2 checkpoint in one process
    resumed = tmp_path / "resumed"
    shutil.copytree(settings.out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    trainer = Trainer.from_run(resumed, progress=False, log=quiet)
    assert trainer.step == 2 and trainer.world.size == 1
    trainer.train()
    again = losses(resumed)
    assert again[:2] == two[:2]
    for step, (a, b) in enumerate(zip(again[2:], two[2:]), 3):
        assert abs(a - b) / abs(b) <= REL_TOL, f"step {step}: resumed {a}, 2 processes {b}"
