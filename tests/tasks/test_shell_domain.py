"""The shell domain (k3/tasks/shell.py): generation, the sandboxed tools, judging on a fork, no leaks."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3.envs import SandboxError
from k3.rl.cold_start import conversations
from k3.tasks import shell
from k3.tasks.domains import continue_with_tool_results, make_domain
from tests.helpers.rl import reference_first_turn


@pytest.fixture(scope="module")
def init_run(tmp_path_factory) -> Path:
    from tests.helpers.train import trained_tiny_run
    return trained_tiny_run(tmp_path_factory.mktemp("pre"))


@pytest.fixture
def own_tmp(sandbox_support, monkeypatch) -> Path:
    """Sandboxes made in this test live under a directory of its own (one the sandbox uid may
    traverse, unlike pytest's tmp_path), so a `k3-envs-*` left there is this test's leak."""
    root = Path(tempfile.mkdtemp(prefix="k3-shell-test-"))
    root.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    shell.release()  # episodes other tests left unjudged are not this test's
    try:
        yield root
        assert shell.live_count() == 0
        shell.close_pool()  # the warm pool's sandboxes are the pool's, not leaks
        assert not list(root.glob("k3-envs-*")), "a sandbox was left behind"
    finally:
        shell.release()
        monkeypatch.undo()
        shutil.rmtree(root, ignore_errors=True)


def _reply(content=None, calls=()):
    return SimpleNamespace(content=content, reasoning="", tool_calls=list(calls), errors=[], complete=True)


def _call(name, arguments, k=1):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"functions.{name}:{k}", "type": "function", "function": {"name": name, "arguments": args}}


def _play(task, turns):
    """Run an episode whose assistant turns make `turns` (lists of calls), then say "Done."."""
    replies, history = [], None
    for calls in turns:
        reply = _reply(calls=calls)
        replies.append(reply)
        history = continue_with_tool_results(task, reply, history)
    replies.append(_reply("Done."))
    return task.verify(replies), history


def test_generation_is_deterministic_with_a_disjoint_heldout_split():
    a, b = make_domain("shell", 3), make_domain("shell", 3)
    train = a.tasks("train", 40)
    assert [t.messages for t in train] == [t.messages for t in b.tasks("train", 40)]
    assert [t.setup for t in train] == [t.setup for t in b.tasks("train", 40)]
    assert [t.messages for t in train] != [t.messages for t in make_domain("shell", 4).tasks("train", 40)]
    held = a.heldout(20)
    assert not {t.item for t in train} & {t.item for t in held}
    assert {t.kind for t in train} == set(shell.KINDS)
    assert all(t.tools and t.max_turns > 1 and t.setup["files"] for t in train)


def test_cold_start_writes_the_reference_episodes():
    convs = conversations(["shell"], 3)
    assert len(convs) == 3 and all(c["tools"] == shell.TOOLS for c in convs)
    assert all([m["role"] for m in c["messages"]] == ["user", "assistant", "tool", "assistant"] for c in convs)


def test_the_reference_policy_scores_every_task(own_tmp):
    domain = make_domain("shell", 1)
    for task in domain.tasks("train", 8) + domain.heldout(4):
        calls = task.reference[0]["tool_calls"]
        score, history = _play(task, [calls])
        assert score.correct, (task.id, score.reason)
        # the reference's tool results (what cold-start SFT shows) are what the sandbox returns
        assert [m["content"] for m in history if m["role"] == "tool"] == \
               [m["content"] for m in task.reference if m["role"] == "tool"]


@pytest.mark.slow  # ~7 s of sandboxed episodes; the default run plays the reference policy's
def test_noop_and_random_policies_score_nothing(own_tmp):
    tasks = make_domain("shell", 2).tasks("train", 8)
    for task in tasks:
        assert not task.verify([_reply("Done.")]).correct
        junk = [_call("bash", {"command": "ls -R; cat */*"}), _call("read_file", {"path": "nope.txt"}, 2),
                _call("write_file", {"path": "junk.txt", "content": "hello\n"}, 3)]
        score, _ = _play(task, [junk])
        assert not score.correct and score.reason and score.bad_calls == 0
    score, _ = _play(tasks[0], [[_call("rm", {"path": "x"}), _call("bash", "{oops", 2)]])
    assert not score.correct and score.bad_calls == 2 and score.tool_calls == 2
    # the reference calls, but the episode ends on a call: no final response
    task = tasks[0]
    calls = task.reference[0]["tool_calls"]
    assert task.verify([_reply(calls=calls)]).reason.startswith("the episode ended on a tool call")


def test_the_reward_judges_a_fork_and_leaves_the_episode_sandbox_unchanged(own_tmp):
    task = make_domain("shell", 0).task("train", 0)
    with shell.ShellEpisode(task) as ep:
        assert ep.judge()  # the initial tree is not the end state
        ep.run_calls(task.reference[0]["tool_calls"])
        before = ep.sandbox.digest()
        assert ep.judge() == ""
        assert ep.sandbox.digest() == before
        ep.sandbox.exec("rm -rf ./*")
        assert "missing" in ep.judge() or "removed" in ep.judge()
        ep.sandbox.exec("head -c 2000000 /dev/urandom > big")  # a tree over the output cap: wrong, no raise
        assert ep.judge().startswith("the end state could not be read")


def test_bad_calls_get_clear_error_results(own_tmp):
    task = make_domain("shell", 0).task("train", 0)
    with shell.ShellEpisode(task) as ep:
        assert ep.call("python", {"code": "1"}).startswith("error: unknown tool 'python' (tools: bash, read_file")
        assert ep.call("bash", "{not json").startswith("error: arguments are not valid JSON")
        assert ep.call("bash", "[1]") == "error: arguments must be a JSON object"
        assert ep.call("write_file", {"path": "a"}) == "error: write_file needs a string argument 'content'"
        assert ep.call("read_file", {"path": "a", "mode": "r"}).startswith("error: read_file takes no argument 'mode'")
        assert ep.call("read_file", {"path": "missing.txt"}).startswith("error: read_file 'missing.txt'")
        assert ep.call("bash", {"command": "  "}) == "error: bash needs a non-empty command"
        assert ep.call("bash", {"command": "echo out; echo err >&2; exit 3"}) == "out\nstderr: err\nexit code 3"
        assert ep.call("write_file", {"path": "d/x.txt", "content": "hi\n"}) == "wrote 3 bytes to d/x.txt"
        assert ep.call("read_file", {"path": "d/x.txt"}) == "hi\n"


def test_episodes_continue_in_their_sandbox_and_close_it(own_tmp):
    task = make_domain("shell", 0).task("train", 0)
    first = _reply(calls=[_call("bash", {"command": "echo 1 > step"})])
    history = continue_with_tool_results(task, first, None)
    assert shell.live_count() == 1  # kept for the next turn
    second = _reply(calls=[_call("bash", {"command": "cat step"})])
    history = continue_with_tool_results(task, second, history)
    assert history[-1]["content"] == "1" and shell.live_count() == 1
    assert not task.verify([first, second, _reply("Done.")]).correct
    assert shell.live_count() == 0  # verify ends the episode
    continue_with_tool_results(task, first, None)
    assert shell.release({task.id}) == 1  # an episode that never reached verify


def test_an_error_mid_episode_closes_the_sandbox(own_tmp, monkeypatch):
    task = make_domain("shell", 0).task("train", 0)

    def boom(self, calls):
        raise RuntimeError("tool crashed")

    monkeypatch.setattr(shell.ShellEpisode, "run_calls", boom)
    with pytest.raises(RuntimeError, match="tool crashed"):
        continue_with_tool_results(task, _reply(calls=[_call("bash", {"command": "true"})]), None)


def test_no_sandbox_on_the_host_is_a_one_line_error(monkeypatch):
    import k3.envs

    def refuse(*a, **k):
        raise SandboxError("bwrap: setting up uid map: Permission denied\nmore detail")

    shell.close_pool()
    monkeypatch.setattr(k3.envs, "SandboxPool", refuse)
    task = make_domain("shell", 0).task("train", 0)
    with pytest.raises(shell.ShellUnavailable) as e:
        continue_with_tool_results(task, _reply(calls=[_call("bash", {"command": "true"})]), None)
    assert str(e.value) == "shell domain: no sandbox on this host: bwrap: setting up uid map: Permission denied"


def test_k3_rl_runs_the_shell_domain(own_tmp, init_run, tmp_path):
    """`k3 rl --domain shell` end to end on a tiny model: every episode judged in its sandbox, none left."""
    from k3.cli import main

    with pytest.raises(SystemExit) as done:
        main(["rl", "--run", str(init_run), "--out", str(tmp_path / "rl"), "--domain", "shell", "--steps", "2",
                 "--prompts", "2", "--samples", "2", "--max-tokens", "8", "--pool", "4", "--heldout", "2",
              "--budget-samples", "1", "--eval-every", "2", "--ckpt-every", "2"])
    assert done.value.code == 0
    held = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "heldout" for r in held)


def test_the_rl_trainer_plays_a_shell_episode_in_its_sandbox(own_tmp, init_run, tmp_path):
    """The reference episode through the trainer's turns (token in / token out): the calls run in the
    episode's sandbox, the reward judges it correct, and the sandbox is closed."""
    from k3.rl.trainer import RLSettings, RLTrainer
    from tests.helpers.train import quiet

    s = RLSettings(init=str(init_run), out=str(tmp_path / "rl"), domain="shell", steps=1, prompts=1, samples=2,
                   max_tokens=4, pool=2, heldout=1, budget_samples=1)
    trainer = RLTrainer(s, progress=False, log=quiet)
    try:
        task = trainer.pool[0]
        first, _, _ = reference_first_turn(trainer, task, task.reference[0])
        _, reply = trainer._reply(first)
        assert reply.tool_calls and not reply.errors
        nxt = trainer._continuation(first, first.uid, task, reply)
        assert shell.live_count() == 1
        history = nxt.tag["messages"]
        answer = trainer.chat.render(history + task.reference[-1:], tools=task.tools, reasoning_effort="max",
                                     add_generation_prompt=False).token_ids[len(nxt.prompt_ids):]
        nxt.completion_ids, nxt.logprobs, nxt.versions = answer, [-1.0] * len(answer), [0] * len(answer)
        nxt.finish_reason = "stop"
        _trained, _advantages, record = trainer.score([(task, [first, nxt])])
        assert record["accuracy"] == 1.0 and shell.live_count() == 0
    finally:
        trainer.close()


def test_an_episode_waiting_for_the_model_keeps_its_sandbox_paused_then_resumes_it(own_tmp):
    """Between turns (for partial rollout, across iterations) the episode's sandbox is paused: no
    process, no cgroup; the next turn resumes the same sandbox, in the state the last calls left."""
    task = make_domain("shell", 0).task("train", 0)
    first = _reply(calls=[_call("bash", {"command": "echo 1 > step; sleep 30 &"})])
    history = continue_with_tool_results(task, first, None)
    (ep,) = [e for eps in shell._live.values() for e in eps]
    assert ep.sandbox.paused and ep.sandbox._cgroup is None and shell.paused_count() == 1
    before = ep.sandbox.name
    history = continue_with_tool_results(task, _reply(calls=[_call("bash", {"command": "cat step"})]), history)
    (again,) = [e for eps in shell._live.values() for e in eps]
    assert again is ep and ep.sandbox.name == before and history[-1]["content"] == "1"
    shell.release({task.id})


def test_bad_commands_and_paths_give_the_model_a_clear_result(own_tmp, monkeypatch):
    monkeypatch.setattr(shell, "EXEC_TIMEOUT_S", 0.5)
    task = make_domain("shell", 0).task("train", 0)
    with shell.ShellEpisode(task) as ep:
        assert ep.call("bash", {"command": "echo started; sleep 1000"}) == \
               "started\nerror: the command was stopped (timeout)"
        assert ep.call("bash", {"command": "printf 'a\\377\\000b'"}) == "a\ufffd\x00b"  # binary: replaced, not raised
        huge = ep.call("bash", {"command": "yes | head -c 200000"})
        assert len(huge) < shell.RESULT_CHARS + 100 and "[output cut:" in huge
        assert "agent:x:" in ep.call("read_file", {"path": "../../../../etc/passwd"})  # the sandbox's own /etc
        ep.call("bash", {"command": "ln -s /work/main/pyproject.toml out"})
        assert ep.call("read_file", {"path": "out"}).startswith("error: read_file 'out': ")
        escape = f"../../../tmp/k3-shell-escape-{os.getpid()}"
        assert ep.call("write_file", {"path": escape, "content": "x"}) == f"wrote 1 bytes to {escape}"
        assert not Path(f"/tmp/k3-shell-escape-{os.getpid()}").exists()  # written in the sandbox's own /tmp
