"""`k3 rl` end to end on a very small model: iterations train, partial rollout loses and duplicates
no episode, a run killed mid-iteration (with paused trajectories) resumes bit for bit, tool
episodes continue token in / token out and train as one row, and bad settings are refused in one line."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest

import k3.rl.trainer as rl_trainer
from k3.rl.objective import trained_tokens
from k3.rl.rollout import Trajectory
from k3.rl.trainer import RLSettings, RLTrainer
from k3.tasks.domains import continue_with_tool_results
from k3.train.errors import TrainError
from tests.helpers.rl import reference_first_turn
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import quiet, trained_tiny_run


@pytest.fixture(scope="module")
def init_run(tmp_path_factory) -> Path:
    return trained_tiny_run(tmp_path_factory.mktemp("pre"))


@pytest.fixture
def varied_rewards(monkeypatch):
    """An untrained model never answers right: give each episode a reward from a hash of its
    tokens, so advantages are not all zero and the gradient path runs."""
    def reward(self, task, turns):
        digest = hashlib.sha256(str([t.completion_ids for t in turns]).encode()).digest()
        return float(digest[0] % 3 - 1), False, sum(len(t.completion_ids) for t in turns)

    monkeypatch.setattr(RLTrainer, "reward", reward)


def settings(init: Path, out: Path, **changes) -> RLSettings:
    base = RLSettings(init=str(init), out=str(out), steps=4, prompts=2, samples=2, max_tokens=12, pool=4, heldout=2,
                      budget_samples=1, eval_every=2, ckpt_every=2, stop_fraction=0.5, temperature=1.5)
    return dataclasses.replace(base, **changes)


def records(run: Path, kind: str) -> list[dict]:
    out = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("rollout_s", "elapsed", "tok_per_s")} for r in out if r["kind"] == kind]


def rl(s: RLSettings, resume: bool = False) -> dict:
    trainer = RLTrainer.from_run(s.out, progress=False, log=quiet) if resume else RLTrainer(s, progress=False, log=quiet)
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_partial_rollout_run_resumes_exactly_and_keeps_every_episode(init_run, tmp_path, varied_rewards):
    s = settings(init_run, tmp_path / "a")
    rl(s)
    straight = records(tmp_path / "a", "train")
    assert any(r["loss"] != 0 for r in straight) and any(r["unfinished"] for r in straight)
    assert any(r["resumed"] for r in straight) and max(r["staleness"] for r in straight) > 0
    # every episode created trained exactly once or is still paused at the end; at most N * K in flight
    assert sum(r["episodes"] for r in straight) + straight[-1]["unfinished"] == sum(r["new"] for r in straight)
    assert all(r["resumed"] + r["new"] <= s.prompts * s.samples for r in straight)
    for name in ("heldout.jsonl", "budgets.json", "loss.png", "report.md"):
        assert (tmp_path / "a" / name).is_file()

    killed = RLTrainer(settings(init_run, tmp_path / "b"), progress=False, log=quiet)
    killed._record([killed.train_step(), killed.train_step()])
    killed._save()  # the step-2 checkpoint, with paused trajectories in it
    assert killed.unfinished
    killed.train_step()  # killed during step 3
    killed.close()
    rl(settings(init_run, tmp_path / "b"), resume=True)
    assert records(tmp_path / "b", "train")[2:] == straight[2:]  # bit for bit after the resume


def test_synchronous_run_finishes_every_episode_and_resumes(init_run, tmp_path, varied_rewards):
    s = settings(init_run, tmp_path / "s", stop_fraction=1.0, steps=2, tau=1.5)
    rl(s)
    for r in records(tmp_path / "s", "train"):
        assert r["episodes"] == 4 and r["unfinished"] == 0 and r["staleness"] == 0
    [sampled] = records(tmp_path / "s", "init_sampled")  # the budget episodes, on the held-out prompts
    assert sampled["prompts"] == s.heldout and sampled["k"] == s.budget_samples
    assert f"pass@{s.budget_samples} " in (tmp_path / "s" / "report.md").read_text()
    resumed = RLTrainer.from_run(tmp_path / "s", progress=False, log=quiet)  # run.json with a set tau reads back
    try:
        assert resumed.s == s and resumed.step == 2
    finally:
        resumed.close()


def test_resume_needs_the_init_run_only_as_a_kl_reference(init_run, tmp_path, varied_rewards):
    """The checkpoint holds the model: with kl 0 a run resumes after its init run was moved away."""
    import shutil

    init = tmp_path / "init"
    shutil.copytree(init_run, init)
    rl(settings(init, tmp_path / "r", stop_fraction=1.0, steps=2))
    shutil.rmtree(init)
    resumed = RLTrainer.from_run(tmp_path / "r", progress=False, log=quiet)
    try:
        assert resumed.step == 2
    finally:
        resumed.close()


def test_resume_reads_the_kl_reference_it_started_with(init_run, tmp_path, varied_rewards):
    """The init run may go on after RL starts: a resume keeps the reference checkpoint of the start
    (sources.json), and says so in one line when that checkpoint was pruned."""
    import shutil

    init = tmp_path / "init"
    shutil.copytree(init_run, init)
    rl(settings(init, tmp_path / "k", stop_fraction=1.0, steps=2, kl_coef=0.1))
    started = Path(json.loads((tmp_path / "k" / "sources.json").read_text())["init"])
    assert started.parent == (init / "checkpoints").resolve()
    shutil.copytree(started, init / "checkpoints" / "step_9999999")  # the init run went on
    resumed = RLTrainer.from_run(tmp_path / "k", progress=False, log=quiet)
    try:
        assert resumed.init_checkpoint == started
    finally:
        resumed.close()
    shutil.rmtree(started)  # ... and pruned the checkpoint RL started from
    with pytest.raises(TrainError, match="started from.*is gone"):
        RLTrainer.from_run(tmp_path / "k", progress=False, log=quiet)


def test_tool_episode_continues_with_the_tool_result(init_run, tmp_path):
    trainer = RLTrainer(settings(init_run, tmp_path / "t", domain="tool", budget_samples=1, max_tokens=4),
                        progress=False, log=quiet)
    try:
        task = trainer.pool[0]
        call = next(m for m in task.reference if m.get("tool_calls"))
        first, prompt, reply_ids = reference_first_turn(trainer, task, call)
        _, reply = trainer._reply(first)
        assert reply.tool_calls and not reply.errors
        nxt = trainer._continuation(first, first.uid, task, reply)
        history = continue_with_tool_results(task, reply)
        assert nxt.prompt_ids == task.render(trainer.chat, history, "max").token_ids
        assert nxt.prompt_ids[:len(prompt) + len(reply_ids)] == list(prompt) + reply_ids  # token in / token out
        assert nxt.tag["turn"] == 2 and nxt.group_id == first.group_id and not nxt.completion_ids
        assert json.loads(json.dumps(rl_trainer._dump(nxt))) == rl_trainer._dump(nxt)  # checkpointable
        # the reference answer as the second turn: a correct episode, trained as one row
        answer = trainer.chat.render(history + task.reference[2:], tools=task.tools, reasoning_effort="max",
                                     add_generation_prompt=False).token_ids[len(nxt.prompt_ids):]
        nxt.completion_ids, nxt.logprobs, nxt.versions = answer, [-1.0] * len(answer), [0] * len(answer)
        nxt.finish_reason = "stop"
        trained, _advantages, record = trainer.score([(task, [first, nxt])])
        assert record["accuracy"] == 1.0 and len(trained) == 1 and trained[0].turns == [first, nxt]
        assert trained_tokens(trained[0]) == len(reply_ids) + len(answer)
        metrics = trainer.optimize(trained, [1.0])
        assert metrics["trained_tokens"] == len(reply_ids) + len(answer) and math.isfinite(metrics["loss"])
    finally:
        trainer.close()


@pytest.mark.parametrize("change, message", [
    ({"domain": "poetry"}, "domain must be one of"),
    ({"samples": 1}, "samples per prompt must be >= 2"),
    ({"stop_fraction": 0.0}, "stop fraction must be in (0, 1]"),
    ({"effort": "medium"}, "effort must be one of"),
    ({"domain_options": {"colour": 1}}, "colour"),
    ({"budgets": "/nonexistent/budgets.json"}, "not a budgets file"),
])
def test_bad_settings_are_one_line_errors(init_run, tmp_path, change, message):
    with pytest.raises(TrainError, match=None) as e:
        RLTrainer(settings(init_run, tmp_path / "x", **change), progress=False, log=quiet)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_budgets_are_measured_through_the_engine(init_run, tmp_path, monkeypatch):
    """Each pool and held-out task gets `budget_samples` episodes as one group of the rollout engine
    (its prompt computed once), the same ones for the same seed, and the cache is empty after."""
    seen = []
    real_run = rl_trainer.Rollouts.run

    def run(self, prompts, K, **kw):
        batch = real_run(self, prompts, K, **kw)
        seen.append((len(prompts), K, batch.prefix_hits))
        return batch

    monkeypatch.setattr(rl_trainer.Rollouts, "run", run)
    budgets = []
    for out in ("m1", "m2"):
        trainer = RLTrainer(settings(init_run, tmp_path / out, budget_samples=3, pool=5, heldout=3), progress=False,
                            log=quiet)
        try:
            assert trainer.rollouts.engine.cache.stats.queries == 0  # a fresh engine for iteration 1
            budgets.append({k: dataclasses.asdict(b) for k, b in trainer.budgets.items()})
        finally:
            trainer.close()
    assert budgets[0] == budgets[1] and len(budgets[0]) == 8
    assert all(b["n_samples"] == 3 for b in budgets[0].values())
    measured = seen[:len(seen) // 2]
    assert sum(n for n, _, _ in measured) == 8 and all(k == 3 for _, k, _ in measured)
    assert sum(h for _, _, h in measured) >= 8 * 2  # each group's two followers reuse the leader's prompt


def test_filter_groups_trains_only_nonzero_advantages(init_run, tmp_path, monkeypatch):
    rewards = {"0/0/0": 1.0, "0/0/1": 1.0, "0/1/0": 1.0, "0/1/1": 0.0}  # group 0 all equal, group 1 not
    monkeypatch.setattr(RLTrainer, "reward", lambda self, task, turns: (rewards[turns[0].uid], False, 1))
    for filtered in (False, True):
        trainer = RLTrainer(settings(init_run, tmp_path / str(filtered), samples=2, filter_groups=filtered),
                            progress=False, log=quiet)
        try:
            completed = [(trainer.pool[0], [Trajectory(uid, uid[:3], 0, 0, [1], 1, 4, tag={"task": 0, "turn": 1})])
                         for uid in rewards]
            trained, advantages, record = trainer.score(completed)
        finally:
            trainer.close()
        if filtered:
            assert [t.uid for t in trained] == ["0/1/0", "0/1/1"] and advantages == [0.5, -0.5]
            assert record["filtered"] == 2
        else:
            assert len(trained) == 4 and advantages == [0.0, 0.0, 0.5, -0.5] and record["filtered"] == 0
