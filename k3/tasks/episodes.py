"""Agent episodes, the one runner SFT evaluation and RL share: a task's prompt, a reply, and while
the reply calls a tool and turns remain, the tool results and the next reply.

A task is anything with the `EpisodeTask` attributes: an RL domain's `Task` (k3/tasks/domains.py)
or a held-out SFT conversation (`ConversationTask`, k3/tasks/scoring.py). Token in / token out
(`next_turn`): the next turn's prompt is this turn's prompt and reply exactly as sampled, then the
tool results and the generation prompt as XTML renders them. The reply is never re-encoded from its
parsed messages: a re-rendered reply can tokenize differently (another BPE split, a reordered
argument), and the model would then answer from a context it never produced.

`play_episodes` runs every turn of every still-running episode as one batch of a `complete`
function (prompts -> generated ids); `run_episodes` is it over `k3.generation.generate`, so greedy
figures are a pure function of the weights and a seed fixes sampled ones. Scoring is the task's
own `verify`; the length is the caller's `measure` (RL: the effort budget's T(y)).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from k3.generation.generate import generate
from k3.tasks.domains import continue_with_tool_results, needs_another_turn
from k3.tasks.shell import release


class EpisodeTask(Protocol):
    id: str
    messages: list[dict]  # the prompt
    tools: list[dict] | None
    max_turns: int

    def render(self, xtml, messages: list[dict] | None = None, effort: str | None = "max"): ...

    def tool_results(self, history: list[dict], calls: list[dict]) -> list[str]: ...

    def verify(self, replies: Sequence) -> Any: ...


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant message: what the model is asked."""
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            return messages[:i]
    return list(messages)


class NextTurn(NamedTuple):
    messages: list[dict]  # the history with the reply and its tool results (for logs and the next turn)
    token_ids: list[int]  # the next turn's prompt: the last prompt and reply as sampled, then the rest rendered
    boundaries: tuple[int, ...]  # message starts in token_ids, for the prefix cache's KDA checkpoints
    rendered: Any  # XTML's rendering of `messages` (what a parser of the next reply needs)


def next_turn(xtml, task: EpisodeTask, effort: str | None, history: list[dict] | None, reply,
              prompt_ids: Sequence[int], completion_ids: Sequence[int], boundaries: Sequence[int] = ()) -> NextTurn:
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


@dataclass
class Episode:
    task: EpisodeTask
    turns: list[list[int]]  # the generated ids of each assistant turn
    replies: list  # the parsed reply of each turn
    score: Any  # task.verify(replies)
    length: int  # the caller's measure of the turns (default: the generated tokens)

    def record(self, tokenizer) -> dict:
        """An RL domain task's episode as one JSON line (heldout.jsonl)."""
        return {"task": self.task.id, "correct": self.score.correct, "reason": self.score.reason,
                "answer": self.score.answer, "truth": self.task.answer, "length": self.length,
                "turns": [tokenizer.decode(t, skip_special_tokens=False) for t in self.turns]}


Complete = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, turn from 1) -> generated ids
Measure = Callable[[EpisodeTask, list[list[int]]], int]


def play_episodes(complete: Complete, xtml, tasks: Sequence[EpisodeTask], effort: str | None, *,
                  measure: Measure | None = None, max_turns: int | None = None) -> list[Episode]:
    """One episode per task (repeat a task to sample it several times), in order; `max_turns` caps
    every task's own limit (1: first replies only)."""
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
            outs = complete([prompts[i] for i in active], turn)
            still = []
            for i, ids in zip(active, outs):
                reply = xtml.parse_reply(rendered[i], ids)
                turns[i].append(list(ids))
                replies[i].append(reply)
                if needs_another_turn(tasks[i], reply, turn) and (max_turns is None or turn < max_turns):
                    nxt = next_turn(xtml, tasks[i], effort, history[i], reply, prompts[i], ids)
                    history[i], prompts[i], rendered[i] = nxt.messages, nxt.token_ids, nxt.rendered
                    still.append(i)
            active = still
        return [Episode(t, turns[i], replies[i], t.verify(replies[i]),
                        measure(t, turns[i]) if measure else sum(map(len, turns[i]))) for i, t in enumerate(tasks)]
    finally:
        release({t.id for t in tasks})  # sandboxes of episodes an error stopped before verify (shell)


@torch.no_grad()
def run_episodes(model, xtml, tasks: Sequence[EpisodeTask], effort: str | None, max_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None, measure: Measure | None = None,
                 max_turns: int | None = None) -> list[Episode]:
    """`play_episodes` with `model` generating up to `max_tokens` a turn, in eval mode."""
    def complete(prompts: list[list[int]], turn: int) -> list[list[int]]:
        return generate(model, prompts, max_tokens, temperature=temperature, eos_token_id=xtml.stop_ids,
                        seed=None if seed is None else seed + turn)

    was_training = model.training
    model.eval()
    try:
        return play_episodes(complete, xtml, tasks, effort, measure=measure, max_turns=max_turns)
    finally:
        model.train(was_training)
