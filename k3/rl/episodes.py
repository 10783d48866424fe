"""Whole episodes of a domain's tasks, batched turn by turn: held-out evaluation and cold-start budgets.

An episode is the task's prompt, a reply, and for the tool domain the tool results and the next
reply, up to `task.max_turns` (k3/rl/domains.py). Every turn of every still-running episode is
generated in one batch (`k3.generation.generate`), so greedy figures are a pure function of the
weights and a seed fixes sampled ones. Scoring is the domain's verifier; the length is the effort
budget's T(y) (k3/rl/effort.py): think tokens for reasoning domains, every generated token for tool.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.generation.generate import generate
from k3.rl.domains import Score, Task, continue_with_tool_results, needs_another_turn
from k3.rl.effort import Budget, length_of, within_budget


@dataclass
class Episode:
    task: Task
    turns: list[list[int]]  # the generated ids of each assistant turn
    replies: list  # the parsed reply of each turn
    score: Score
    length: int  # T(y)

    def record(self, tokenizer, budget: Budget | None = None, tau: float | None = None) -> dict:
        out = {"task": self.task.id, "correct": self.score.correct, "reason": self.score.reason,
               "answer": self.score.answer, "truth": self.task.answer, "length": self.length,
               "turns": [tokenizer.decode(t, skip_special_tokens=False) for t in self.turns]}
        if budget is not None and tau is not None:
            out["budget"] = tau * budget.b0
        return out


@torch.no_grad()
def run_episodes(model, xtml, tasks: Sequence[Task], effort: str, max_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None) -> list[Episode]:
    """One episode per task (repeat a task to sample it several times), in order."""
    was_training = model.training
    model.eval()
    try:
        history = [list(t.messages) for t in tasks]
        turns: list[list[list[int]]] = [[] for _ in tasks]
        replies: list[list] = [[] for _ in tasks]
        active = list(range(len(tasks)))
        turn = 0
        while active:
            turn += 1
            rendered = [tasks[i].render(xtml, history[i], effort) for i in active]
            outs = generate(model, [r.token_ids for r in rendered], max_tokens, temperature=temperature,
                            eos_token_id=xtml.stop_ids, seed=None if seed is None else seed + turn)
            still = []
            for i, r, ids in zip(active, rendered, outs):
                reply = xtml.parse_reply(r, ids)
                turns[i].append(list(ids))
                replies[i].append(reply)
                if needs_another_turn(tasks[i], reply, turn):
                    history[i] = continue_with_tool_results(tasks[i], reply, history[i])
                    still.append(i)
            active = still
    finally:
        model.train(was_training)
    return [Episode(t, turns[i], replies[i], t.verify(replies[i]), length_of(turns[i], t.domain, xtml))
            for i, t in enumerate(tasks)]


def summarize(episodes: Sequence[Episode], budgets: dict[str, Budget], tau: float) -> dict:
    """Accuracy, mean T(y), the share within tau * b0 and mean generated tokens of a set of episodes."""
    n = max(len(episodes), 1)
    return {"accuracy": sum(e.score.correct for e in episodes) / n,
            "mean_length": sum(e.length for e in episodes) / n,
            "within_budget": sum(within_budget(e.length, budgets[e.task.id].b0, tau) for e in episodes) / n,
            "generated": sum(sum(len(t) for t in e.turns) for e in episodes) / n,
            "episodes": len(episodes)}
