"""RL test helpers: a reference turn fed through the trainer as if the policy had sampled it."""
from __future__ import annotations


def reference_first_turn(trainer, task, call: dict):
    """A first-turn Trajectory whose completion is `call` (a reference assistant message) exactly as
    the trainer's chat renders it after the task's prompt: (trajectory, prompt ids, reply ids)."""
    from k3.rl.rollout import Trajectory

    prompt = list(task.render(trainer.chat, None, "max").token_ids)
    whole = trainer.chat.render(task.messages + [call], tools=task.tools, reasoning_effort="max",
                                add_generation_prompt=False).token_ids
    reply_ids = list(whole[len(prompt):])
    first = Trajectory("0/0/0", "0/0", 0, 0, prompt, 1, 64, tag={"task": 0, "turn": 1}, completion_ids=reply_ids,
                       logprobs=[-1.0] * len(reply_ids), versions=[0] * len(reply_ids), finish_reason="stop")
    return first, prompt, reply_ids
