"""Whole episodes of a domain's tasks: their turns token in / token out, one training row per
episode, and batched greedy episodes for held-out evaluation.

An episode is the task's prompt, a reply, and for the tool domain the tool results and the next
reply, up to `task.max_turns` (k3/tasks/domains.py). Token in / token out (`next_turn`): the next
turn's prompt is this turn's prompt and reply exactly as sampled, then the tool results and the
generation prompt as XTML renders them. The reply is never re-encoded from its parsed messages: a
re-rendered reply can tokenize differently (another BPE split, a reordered argument), and the policy
would then answer from a context it never produced. So each turn's prompt extends the previous
turn's whole sequence, and an episode trains as one row (`train_rows`): the first prompt once, every
reply's tokens trained, the tool results masked; rather than every earlier turn again as the next
turn's prompt.

`run_episodes` generates every turn of every still-running episode in one batch
(`k3.generation.generate`), so greedy figures are a pure function of the weights and a seed fixes
sampled ones. Scoring is the domain's verifier; the length is the effort budget's T(y)
(k3/rl/effort.py): think tokens for reasoning domains, every generated token for tool.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from k3.generation.generate import generate
from k3.rl.effort import Budget, length_of, within_budget
from k3.tasks.domains import Score, Task, continue_with_tool_results, needs_another_turn
from k3.tasks.shell import release


class NextTurn(NamedTuple):
    messages: list[dict]  # the history with the reply and its tool results (for logs and the next turn)
    token_ids: list[int]  # the next turn's prompt: the last prompt and reply as sampled, then the rest rendered
    boundaries: tuple[int, ...]  # message starts in token_ids, for the prefix cache's KDA checkpoints
    rendered: Any  # XTML's rendering of `messages` (what a parser of the next reply needs)


def next_turn(xtml, task: Task, effort: str, history: list[dict] | None, reply, prompt_ids: Sequence[int],
              completion_ids: Sequence[int], boundaries: Sequence[int] = ()) -> NextTurn:
    """The next turn of a tool episode, token in / token out: `history` (None: the task's prompt) was
    rendered as `prompt_ids` (with `boundaries`), the model sampled `completion_ids`, parsed as `reply`."""
    messages = continue_with_tool_results(task, reply, history)
    through_reply = len(task.messages if history is None else history) + 1
    head = xtml.render(messages[:through_reply], tools=task.tools, reasoning_effort=effort, add_generation_prompt=False)
    full = task.render(xtml, messages, effort)
    n = len(head.token_ids)
    if full.token_ids[:n] != head.token_ids:  # markers end every message, so this holds for any history
        raise AssertionError(f"{task.id}: the rendered history is not a prefix of the next turn's prompt")
    base = list(prompt_ids) + list(completion_ids)
    shift = len(base) - n
    return NextTurn(messages, base + full.token_ids[n:],
                    tuple(boundaries) + tuple(b + shift for b in full.boundaries if b >= n), full)


@dataclass(eq=False)
class EpisodeRow:
    """A multi-turn episode as one training sequence: its first prompt, then every later token,
    the replies trained (their behaviour log-probs and versions) and the tool results and
    generation prompts between them masked out (`completion_mask` False, log-prob 0, version -1)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    completion_mask: list[bool]
    tag: Any = None
    group_id: str = ""
    turns: list = field(default_factory=list, repr=False)


def train_rows(turns: Sequence) -> list:
    """The training rows of an episode's turns (k3.rl.rollout.Trajectory): the one trajectory of a
    one-turn episode; one EpisodeRow when each turn's prompt extends the previous turn's sequence
    (token in / token out); else the turns as they are."""
    if len(turns) == 1:
        return [turns[0]]
    row = EpisodeRow(list(turns[0].prompt_ids), list(turns[0].completion_ids), list(turns[0].logprobs),
                     list(turns[0].versions), [True] * len(turns[0].completion_ids), turns[0].tag,
                     turns[0].group_id, list(turns))
    for t in turns[1:]:
        seen = row.prompt_ids + row.completion_ids
        if list(t.prompt_ids[:len(seen)]) != seen:
            return list(turns)
        between = len(t.prompt_ids) - len(seen)
        row.completion_ids += list(t.prompt_ids[len(seen):]) + list(t.completion_ids)
        row.logprobs += [0.0] * between + list(t.logprobs)
        row.versions += [-1] * between + list(t.versions)
        row.completion_mask += [False] * between + [True] * len(t.completion_ids)
    return [row]


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
        history: list[list[dict] | None] = [None] * len(tasks)
        rendered = [t.render(xtml, None, effort) for t in tasks]
        prompts = [list(r.token_ids) for r in rendered]
        turns: list[list[list[int]]] = [[] for _ in tasks]
        replies: list[list] = [[] for _ in tasks]
        active = list(range(len(tasks)))
        turn = 0
        while active:
            turn += 1
            outs = generate(model, [prompts[i] for i in active], max_tokens, temperature=temperature,
                            eos_token_id=xtml.stop_ids, seed=None if seed is None else seed + turn)
            still = []
            for i, ids in zip(active, outs):
                reply = xtml.parse_reply(rendered[i], ids)
                turns[i].append(list(ids))
                replies[i].append(reply)
                if needs_another_turn(tasks[i], reply, turn):
                    nxt = next_turn(xtml, tasks[i], effort, history[i], reply, prompts[i], ids)
                    history[i], prompts[i], rendered[i] = nxt.messages, nxt.token_ids, nxt.rendered
                    still.append(i)
            active = still
        return [Episode(t, turns[i], replies[i], t.verify(replies[i]), length_of(turns[i], t.domain, xtml))
                for i, t in enumerate(tasks)]
    finally:
        model.train(was_training)
        release({t.id for t in tasks})  # sandboxes of episodes an error stopped before verify (shell)


def summarize(episodes: Sequence[Episode], budgets: dict[str, Budget], tau: float) -> dict:
    """Accuracy, mean T(y), the share within tau * b0 and mean generated tokens of a set of episodes."""
    n = max(len(episodes), 1)
    return {"accuracy": sum(e.score.correct for e in episodes) / n,
            "mean_length": sum(e.length for e in episodes) / n,
            "within_budget": sum(within_budget(e.length, budgets[e.task.id].b0, tau) for e in episodes) / n,
            "generated": sum(sum(len(t) for t in e.turns) for e in episodes) / n,
            "episodes": len(episodes)}
