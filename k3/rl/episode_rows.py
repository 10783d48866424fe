"""An RL episode as training rows: a multi-turn episode, whose turns were sampled token in / token
out (`k3.tasks.episodes.next_turn`), trains as one sequence: the first prompt once, every reply's
tokens trained, the tool results and generation prompts between them masked out; rather than every
earlier turn again as the next turn's prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
