"""FSDP2 VL training on CPU: `torchrun --nproc-per-node 2` (gloo) over the micro VL config matches
one process with the same global batch (each rank trains on its half of the step's text windows
and scenes), and its checkpoint resumes in a single process.

Tolerance as tests/train/test_fsdp.py: relative 1e-5 per step's losses, which differ only in
summation order (each rank sums its half; gradients are reduce-scattered). Both runs use
`balance="histogram"`: QB pooled over ranks, the same rule in both.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3.train.metrics import MetricsLog
from k3.train.vl_trainer import VLTrainer
from tests.helpers.train import REPO, quiet
from tests.train.test_vl_trainer import micro_settings, train_records

REL_TOL = 1e-5
RUN = """
import json, sys
from k3.train.vl_trainer import VLSettings, VLTrainer
s = json.loads(open(sys.argv[1]).read())
s["sample_prompts"] = tuple(s["sample_prompts"])
VLTrainer(VLSettings(**s), progress=False).train()
"""


def _close(a: list[tuple], b: list[tuple], what: str) -> None:
    assert len(a) == len(b), (len(a), len(b))
    for step, (x, y) in enumerate(zip(a, b), 1):
        for u, v in zip(x, y):
            assert abs(u - v) <= REL_TOL * abs(v), f"{what}, step {step}: {x} against {y}"


def test_ranks_share_out_the_one_process_step():
    """The default run's check of the split the two-process test below (`-m slow`) trains on: the
    ranks' contiguous shares of a step's windows and scenes, in rank order, are the one-process
    step's, for any world size that divides them. FSDP itself against one process, and resuming
    its checkpoint in one process: tests/train/test_fsdp.py (the text trainer)."""
    windows, scenes = list(range(12)), list(range(100, 104))
    for size in (1, 2, 4):
        shares = [VLTrainer.rank_items(SimpleNamespace(step_items=lambda: (windows, scenes),
                                                       world=SimpleNamespace(rank=rank, size=size)))
                  for rank in range(size)]
        assert [w for ws, _ in shares for w in ws] == windows and [d for _, ds in shares for d in ds] == scenes
        assert {len(ws) for ws, _ in shares} == {len(windows) // size}


@pytest.mark.slow  # three processes each importing torch and k3, then two more runs: ~10-15 s on 2 cores
def test_two_process_vl_matches_one_process_and_resumes_single(tmp_path):
    same = {"balance": "histogram", "keep": 3, "keep_all_state": True}  # every checkpoint resumable
    two = micro_settings(tmp_path, "two", **same)
    script, settings_file = tmp_path / "run_vl.py", tmp_path / "two.json"
    script.write_text(RUN)
    settings_file.write_text(json.dumps(dataclasses.asdict(two)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(settings_file)], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = MetricsLog(Path(two.out)).read()
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]  # rank 0 alone writes
    assert len([r for r in records if r["kind"] == "vqa"]) == 1
    assert (Path(two.out) / "loss.png").is_file() and (Path(two.out) / "checkpoints" / "step_0000004").is_dir()

    one = micro_settings(tmp_path, "one", **same)
    VLTrainer(one, progress=False, log=quiet).train()
    _close(train_records(two.out), train_records(one.out), "2 processes against 1")
    evals = [[r["val_image_loss"] for r in MetricsLog(Path(run)).read() if r["kind"] == "eval"] for run in (two.out, one.out)]
    _close([tuple(evals[0])], [tuple(evals[1])], "held-out reply loss")

    resumed = tmp_path / "resumed"  # the 2-process run's step-2 checkpoint, continued in one process
    shutil.copytree(two.out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    trainer = VLTrainer.from_run(resumed, progress=False, log=quiet)
    assert trainer.step == 2 and trainer.world.size == 1
    trainer.train()
    again, ref = train_records(resumed), train_records(two.out)
    assert again[:2] == ref[:2]
    _close(again[2:], ref[2:], "resumed in 1 process against 2 processes")
