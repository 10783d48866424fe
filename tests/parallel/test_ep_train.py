"""`torchrun --nproc-per-node 4 -m k3 train --ep E --dp D` on CPU (gloo): EP=2 x DP=2 and EP=4, with
MoonEP's balanced plan (expert copies), match one process over 3 steps within 1e-5 relative per
step's loss, and a checkpoint saved under EP=2 x DP=2 resumes in one process and under EP=4.

Both runs use `--balance histogram` (QB pooled over ranks, as test_fsdp does). A step's loss
depends on the previous steps' gradients through the optimizer, so equal losses over 3 steps
check the gradients too. Slow: three 4-process jobs, about a minute each on 2 busy cores.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from k3.train.trainer import Trainer, TrainSettings
from tests.helpers.train import REPO, losses, quiet, tiny_settings

REL_TOL = 1e-5


def _torchrun(settings: TrainSettings, *extra: str, resume: str | None = None) -> subprocess.CompletedProcess:
    if resume:
        argv = ["--resume", resume, "--no-progress"]
    else:
        argv = ["--config", settings.config, "--data", settings.data, "--out", settings.out, "--steps", "3",
                "--batch-size", "4", "--seq-len", str(settings.seq_len), "--lr", str(settings.lr),
                "--eval-every", "3", "--ckpt-every", "2", "--keep", "3", "--balance", "histogram",
                "--cache-dir", settings.cache_dir, "--no-progress", "--keep-all-state", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           "-m", "k3", "train", *argv], check=False, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() and "elastic" not in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), f"{what}: {a} vs {b}"
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) / abs(x) <= REL_TOL, f"{what}, step {step}: {x} vs {y}"


@pytest.mark.slow
def test_ep_layouts_match_one_process_and_resume_across_layouts(tmp_path):
    settings = tiny_settings(tmp_path, "ep2dp2", steps=3, batch_size=4, balance="histogram")
    _torchrun(settings, "--ep", "2", "--dp", "2")
    ep2 = losses(settings.out)

    saved = json.loads((tmp_path / "ep2dp2" / "run.json").read_text())
    single = TrainSettings(**{**saved, "out": str(tmp_path / "one"), "ep": 1, "dp": None,
                              "sample_prompts": tuple(saved["sample_prompts"])})
    Trainer(single, progress=False, log=quiet).train()
    one = losses(single.out)
    _close(one, ep2, "1 process vs EP2 x DP2")

    ep4 = dataclasses.replace(single, out=str(tmp_path / "ep4"))
    _torchrun(ep4, "--ep", "4")
    _close(one, losses(ep4.out), "1 process vs EP4")

    # the EP2 x DP2 checkpoint at step 2 resumes in one process ...
    resumed = tmp_path / "resumed-one"
    shutil.copytree(settings.out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000003")
    trainer = Trainer.from_run(resumed, progress=False, log=quiet)
    assert trainer.step == 2 and trainer.world.size == 1
    trainer.train()
    _close(ep2, losses(resumed), "EP2 x DP2 resumed in 1 process")
    # ... and under EP=4 (the run's saved layout changed to EP=4)
    resumed4 = tmp_path / "resumed-ep4"
    shutil.copytree(settings.out, resumed4)
    shutil.rmtree(resumed4 / "checkpoints" / "step_0000003")
    run_json = resumed4 / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "ep": 4, "dp": 1}))
    _torchrun(settings, resume=str(resumed4))
    _close(ep2, losses(resumed4), "EP2 x DP2 resumed under EP4")
