"""Effort control (DESIGN §13.2): a cold-start budget b0(x) per prompt, a reward of -1 for a
trajectory longer than tau * b0(x), and three effort levels that differ only in tau.

- Length T(y) (`length_of`): for the reasoning domains (arithmetic, strings) the think tokens; for
  the agentic domain (tool) every generated token of every assistant turn (reasoning, response,
  tool-call markup and arguments), not the prompt or the tool results (DESIGN §13.2: "agentic
  task: reasoning, tool-call arguments and the rest of the cumulative output").
- Budget b0(x) (`cold_start_budgets`): the MEDIAN length of the SFT model's correct samples of x.
  The median, not the mean: with K samples at temperature 1 one correct but rambling sample
  would drag a mean far up, while the median is what a typical correct solution of x needs. Not
  the shortest either: that is luck, and tau scales from a typical length. A prompt with no correct
  sample gets the T(y) of its own reference solution when the caller gives it (`reference_length`:
  the domains are generated, so every prompt has one), else its domain's median b0 (over the
  prompts that had one); a domain with none at all gets a default (DEFAULT_BUDGET). Not the
  domain median first: the prompts an SFT model solves are the short ones, so their median would
  put the long unsolved ones over budget even at max effort, and -1 would teach it to stop
  thinking rather than to solve them. Every b0
  is at least MIN_BUDGET tokens, so a prompt the SFT model answered without thinking still leaves
  the max expert room to think.
- Levels (`EFFORTS`): max has the large tau (TAU_MAX = 2: twice what SFT needed, so it seldom
  binds and max learns to solve); high and low are derived from max by lowering tau (each half the
  level above: 1 and 0.5), trained in that order (`Effort.parent`, the level each tau derives
  from), all against max's b0: the policy learns to solve within the budget, rather than being cut
  off at inference (DESIGN §13.2). Which checkpoint a level starts from is the caller's choice
  (docs/RL.md "The low expert"). Each level is given to the model by
  XTML's effort message (`Effort.xtml_kwargs()` -> `reasoning_effort="low" | "high" | "max"`,
  k3/text/xtml.py).
"""
from __future__ import annotations

import json
import math
import numbers
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from k3.atomic import write_text_atomic
from k3.tasks.domains import DOMAINS
from k3.text.xtml import EFFORTS as XTML_EFFORTS

TAU_MAX = 2.0
MIN_BUDGET = 8.0  # tokens: the floor of every b0
# tokens, for a domain where the SFT model solved nothing: a little above the reference solutions'
# T(y) at the default difficulty in k3-tiny's 4096-token BPE (at most 40 / 23 think tokens, a
# median of ~135 generated tokens for the tool episode); `reference_length` measures them for any tokenizer
DEFAULT_BUDGET = {"arithmetic": 48.0, "strings": 32.0, "tool": 160.0, "shell": 320.0}


@dataclass(frozen=True)
class Effort:
    name: str  # the XTML effort level: low / high / max
    tau: float  # a trajectory longer than tau * b0(x) gets reward -1
    parent: str | None  # the level this one's tau is derived from (None: max)

    def budget(self, b0: float) -> float:
        return self.tau * b0

    def xtml_kwargs(self) -> dict:
        """The render arguments that put this level's effort message in the prompt."""
        return {"reasoning_effort": self.name}


EFFORTS: dict[str, Effort] = {
    "max": Effort("max", TAU_MAX, None),
    "high": Effort("high", TAU_MAX / 2, "max"),
    "low": Effort("low", TAU_MAX / 4, "high"),
}
if set(EFFORTS) != set(XTML_EFFORTS):
    raise AssertionError(f"effort levels {sorted(EFFORTS)} differ from XTML's {sorted(XTML_EFFORTS)}")


def effort(name: str) -> Effort:
    if name not in EFFORTS:
        raise ValueError(f"effort must be one of {list(EFFORTS)}, got {name!r}")
    return EFFORTS[name]


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r} (known: {', '.join(DOMAINS)})")


# ---- length

def think_tokens(ids: Sequence[int], xtml, opened: str = "think") -> int:
    """Tokens a reply spends in its think channel: from the start (a prompt that `opened` the think
    channel) to where the channel ends: `<|close|>think`, an opening response / tools / call
    element (which closes it, as the parser reads it), the message's close, or a stop token. Markup
    of stray elements inside the channel counts as thinking, so it cannot hide thinking."""
    if opened != "think":
        return 0
    ends = {(xtml.close, "think"), (xtml.close, "message"), (xtml.open, "response"), (xtml.open, "tools"),
            (xtml.open, "call")}
    stops = set(xtml.stop_ids)
    i = 0
    while i < len(ids):
        token = int(ids[i])
        if token in stops:
            return i
        if token in (xtml.open, xtml.close):
            header = bytearray()
            j = i + 1
            while j < len(ids) and int(ids[j]) not in (xtml.open, xtml.close, xtml.sep, *stops):
                header += xtml.token_bytes[int(ids[j])] if int(ids[j]) < len(xtml.token_bytes) else b""
                j += 1
            words = header.decode("utf-8", "replace").split()
            if j < len(ids) and int(ids[j]) == xtml.sep and (token, words[0] if words else "") in ends:
                return i
            i = j  # the header read; a marker that ended it is looked at next
            continue
        i += 1
    return len(ids)


def length_of(generated: Sequence[int] | Sequence[Sequence[int]], domain: str, xtml, opened: str = "think") -> int:
    """T(y) of a trajectory: `generated` is the sampled token ids of its assistant turns (one list, or
    one per turn, each starting right after that turn's generation prompt, which `opened` the think
    channel, or another element). Think tokens for a reasoning domain, all of them for an agentic one."""
    _check_domain(domain)
    turns = [generated] if not len(generated) or isinstance(generated[0], numbers.Integral) else generated
    if DOMAINS[domain].agentic:
        return sum(len(t) for t in turns)
    return sum(think_tokens(t, xtml, opened) for t in turns)


def episode_length(xtml) -> Callable:
    """T(y) of an episode's turns, as `run_episodes(measure=...)` takes it (k3/tasks/episodes.py)."""
    return lambda task, turns: length_of(turns, task.domain, xtml)


# ---- budgets and the shaped reward

@dataclass(frozen=True)
class Budget:
    task_id: str
    domain: str
    b0: float  # tokens
    # "correct": median of this prompt's correct samples; "reference": its reference solution's T(y);
    # "domain": the domain's median; "default"
    source: str
    n_samples: int
    n_correct: int


def sampled_figures(budgets: Iterable[Budget]) -> dict | None:
    """What budget episodes say about the model that sampled them, over these prompts: pass@k (the
    share solved by at least one of its k samples) and the sampled accuracy; None when nothing was
    sampled. Sharpening the policy can turn at most pass@k into greedy accuracy without teaching new
    solutions, so pass@k is the figure to read a run's gain against (docs/LOG.md "RL and distillation")."""
    sampled = [b for b in budgets if b.n_samples]
    if not sampled:
        return None
    return {"prompts": len(sampled), "k": min(b.n_samples for b in sampled),
            "pass_at_k": sum(b.n_correct > 0 for b in sampled) / len(sampled),
            "accuracy": sum(b.n_correct for b in sampled) / sum(b.n_samples for b in sampled)}


def reference_length(task, xtml, effort_name: str = "max") -> int:
    """T(y) of the task's reference solution (k3/tasks/domains.py), rendered in `xtml`'s tokens."""
    history, turns = list(task.messages), []
    for m in task.reference:
        if m["role"] == "assistant":
            prompt = task.render(xtml, history, effort_name).token_ids
            full = xtml.render(history + [m], tools=task.tools, reasoning_effort=effort_name,
                               add_generation_prompt=False).token_ids
            turns.append(full[len(prompt):])
        history.append(m)
    return length_of(turns, task.domain, xtml)


def cold_start_budgets(samples: Mapping[str, Sequence[tuple[bool, int]]], domain: str,
                       default: float | None = None, reference: Mapping[str, int] | None = None) -> dict[str, Budget]:
    """b0(x) for each prompt of one domain from the SFT model's samples: task id -> [(correct,
    length)...], the lengths measured by `length_of`. `reference`: task id -> T(y) of its reference
    solution, the b0 of a prompt with no correct sample. `default`: the b0 when nothing in the
    domain was solved and no reference is given (DEFAULT_BUDGET[domain] if None). See the module
    docstring for the rule."""
    _check_domain(domain)
    if default is not None and (isinstance(default, bool) or not isinstance(default, (int, float))
                                or not math.isfinite(default) or default <= 0):
        raise ValueError(f"default must be a finite number > 0, got {default!r}")
    per_task: dict[str, float] = {}
    for task_id, group in samples.items():
        lengths = []
        for correct, length in group:
            if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                raise ValueError(f"{task_id}: a sample length must be an integer >= 0, got {length!r}")
            if correct:
                lengths.append(length)
        if lengths:
            per_task[task_id] = max(float(statistics.median(lengths)), MIN_BUDGET)
    if per_task:
        fallback, source = float(statistics.median(per_task.values())), "domain"
    else:
        fallback, source = float(default or DEFAULT_BUDGET[domain]), "default"
    out = {}
    for task_id, group in samples.items():
        n_correct = sum(bool(c) for c, _ in group)
        b0, why = per_task.get(task_id), "correct"
        if b0 is None and reference is not None and task_id in reference:
            b0, why = max(float(reference[task_id]), MIN_BUDGET), "reference"
        if b0 is None:
            b0, why = max(fallback, MIN_BUDGET), source
        out[task_id] = Budget(task_id, domain, b0, why, len(group), n_correct)
    return out


def within_budget(length: int, b0: float, tau: float) -> bool:
    _check_reward_inputs(length, b0, tau)
    return length <= tau * b0


def summarize(episodes: Sequence, budgets: Mapping[str, Budget], tau: float) -> dict:
    """Accuracy, mean T(y), the share within tau * b0 and mean generated tokens of a set of episodes
    (k3.tasks.episodes.Episode, measured by `episode_length`)."""
    n = max(len(episodes), 1)
    return {"accuracy": sum(e.score.correct for e in episodes) / n,
            "mean_length": sum(e.length for e in episodes) / n,
            "within_budget": sum(within_budget(e.length, budgets[e.task.id].b0, tau) for e in episodes) / n,
            "generated": sum(sum(len(t) for t in e.turns) for e in episodes) / n,
            "episodes": len(episodes)}


def shaped_reward(correct: bool | float, length: int, b0: float, tau: float) -> float:
    """-1 for a trajectory longer than tau * b0, else the correctness reward (1 correct, 0 wrong;
    a float in [0, 1] passes through)."""
    _check_reward_inputs(length, b0, tau)
    reward = float(correct)
    if not 0.0 <= reward <= 1.0:
        raise ValueError(f"the correctness reward must be in [0, 1], got {correct!r}")
    return -1.0 if length > tau * b0 else reward


def _check_reward_inputs(length, b0, tau) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an integer >= 0, got {length!r}")
    for name, v in (("b0", b0), ("tau", tau)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


# ---- persistence (a run keeps its budgets, so a resumed run shapes rewards the same way)

def save_budgets(path: str | Path, budgets: Iterable[Budget]) -> Path:
    rows = sorted((asdict(b) for b in budgets), key=lambda r: r["task_id"])
    return write_text_atomic(path, json.dumps({"budgets": rows}, indent=1) + "\n")


def load_budgets(path: str | Path) -> dict[str, Budget]:
    try:
        rows = json.loads(Path(path).read_text())["budgets"]
        return {r["task_id"]: Budget(**r) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a budgets file ({e})") from None
