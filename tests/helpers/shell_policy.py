"""A scripted policy for `k3 rl --domain shell` runs in tests: whatever tokens the tiny model samples,
each turn's reply is read as the reference solution's calls plus a probe of the sandbox's state
(turn 1), a second probe (turn 2), then "Done." (turn 3). The second probe's result is "t1\\nt2"
only if turn 2 ran in the state turn 1 left, however many iterations (or a resume) came between."""
from __future__ import annotations

import json
from types import SimpleNamespace

PROBE = "echo t{turn} >> .trace; cat .trace"


def _call(name: str, arguments: dict, k: int) -> dict:
    return {"id": f"functions.{name}:{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def scripted_reply(task, turn: int):
    if turn >= 3:
        return SimpleNamespace(content="Done.", reasoning="", tool_calls=[], errors=[], complete=True)
    calls = list(task.reference[0]["tool_calls"]) if turn == 1 else []
    calls.append(_call("bash", {"command": PROBE.format(turn=turn)}, len(calls) + 1))
    return SimpleNamespace(content=None, reasoning="", tool_calls=calls, errors=[], complete=True)


def install(setattr) -> None:
    """Patch RLTrainer (through `setattr(obj, name, value)`, e.g. monkeypatch.setattr) to play the
    script: its replies, and every finished turn a stop (so a tool turn continues)."""
    from k3.rl.rollout import Rollouts
    from k3.rl.trainer import RLTrainer

    def reply(self, t):
        task, _ = self.task_of(t.tag)
        return task, scripted_reply(task, t.tag["turn"])

    run = Rollouts.run

    def run_stopping(self, *args, **kwargs):
        batch = run(self, *args, **kwargs)
        for t in batch.finished:
            t.finish_reason = "stop"
        return batch

    setattr(RLTrainer, "_reply", reply)
    setattr(Rollouts, "run", run_stopping)
