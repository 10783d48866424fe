"""`k3 distill` on a very small model: the per-token signal is teacher minus behaviour log-prob on
the student's own tokens (checked by hand), each trajectory is scored by its own teacher, the run
resumes exactly, and bad teachers are refused in one line."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from k3.rl.distill import DistillSettings, DistillTrainer
from k3.rl.objective import pack_trajectories, token_logprobs
from k3.rl.trainer import RLSettings, RLTrainer
from k3.train.errors import TrainError
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import quiet, trained_tiny_run


def _run(trainer) -> None:
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny init run and two RL 'experts' of it (arithmetic at max and low effort, two iterations each)."""
    root = tmp_path_factory.mktemp("mopd")
    init = trained_tiny_run(root)
    teachers = []
    for effort in ("max", "low"):
        s = RLSettings(init=str(init), out=str(root / f"rl-{effort}"), effort=effort, steps=2, prompts=2, samples=2,
                       max_tokens=6, pool=4, heldout=2, budget_samples=1, eval_every=2, ckpt_every=2, lr=3e-2)
        _run(RLTrainer(s, progress=False, log=quiet))
        teachers.append(root / f"rl-{effort}")
    return init, teachers


def settings(pipeline, out: Path, **changes) -> DistillSettings:
    init, teachers = pipeline
    base = DistillSettings(init=str(init), teachers=[str(t) for t in teachers], out=str(out), steps=3, prompts=1,
                           samples=2, max_tokens=6, pool=4, heldout=2, eval_every=2, ckpt_every=2, lr=3e-2)
    return dataclasses.replace(base, **changes)


def test_signal_is_teacher_minus_behaviour_per_token(pipeline, tmp_path):
    trainer = DistillTrainer(settings(pipeline, tmp_path / "d"), progress=False, log=quiet)
    try:
        completed, _ = trainer.rollout()
        row = [t for _, turns in completed for t in turns]
        assert {t.tag["teacher"] for t in row} == {0, 1}
        batch = pack_trajectories(row, [0.0] * len(row))
        adv = trainer.token_advantages(batch, row)
        starts = batch.cu_seqlens.tolist()
        for n, t in enumerate(row):  # each trajectory alone, through its own teacher
            alone = pack_trajectories([t], [0.0])
            lp = token_logprobs(trainer.teachers[t.tag["teacher"]].model, alone, temperature=trainer.s.temperature)
            want = torch.where(alone.mask, lp - alone.old_logprobs, torch.zeros_like(lp))
            torch.testing.assert_close(adv[starts[n]:starts[n + 1]], want, rtol=1e-5, atol=1e-5)
        assert not adv[~batch.mask].any()
    finally:
        trainer.close()


def test_distill_trains_reports_and_resumes_exactly(pipeline, tmp_path):
    _run(DistillTrainer(settings(pipeline, tmp_path / "a"), progress=False, log=quiet))
    records = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in records if r["kind"] == "heldout"]
    assert set(held[-1]["experts"]) == {"arithmetic-max", "arithmetic-low"}
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| arithmetic-low |" in report and "teacher accuracy" in report
    straight = [r["loss"] for r in records if r["kind"] == "train"]
    assert any(x != 0 for x in straight)

    killed = DistillTrainer(settings(pipeline, tmp_path / "b"), progress=False, log=quiet)
    killed._record([killed.train_step(), killed.train_step()])
    killed._save()
    killed.train_step()
    killed.close()
    _run(DistillTrainer.from_run(tmp_path / "b", progress=False, log=quiet))
    resumed = [json.loads(l)["loss"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
               if json.loads(l)["kind"] == "train"]
    assert resumed == straight


@pytest.mark.parametrize("change, message", [
    ({"teachers": []}, "at least one teacher"),
    ({"teachers": ["/nonexistent/run"]}, "is not a `k3 rl` run"),
])
def test_bad_teachers_are_one_line_errors(pipeline, tmp_path, change, message):
    with pytest.raises(TrainError) as e:
        DistillTrainer(settings(pipeline, tmp_path / "x", **change), progress=False, log=quiet)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_two_teachers_of_one_expert_are_refused(pipeline, tmp_path):
    _, teachers = pipeline
    with pytest.raises(TrainError, match="same domain and effort"):
        DistillTrainer(settings(pipeline, tmp_path / "y", teachers=[str(teachers[0])] * 2), progress=False, log=quiet)
