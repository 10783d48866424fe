"""Verifiable RL task domains, generated procedurally: the stand-ins for the report's three RL
domains (DESIGN §13.2: general reasoning, general agents, coding agents), each checked exactly.

Four domains, each a deterministic function of (seed, options, split, index), so a trainer that
records an index resumes onto the same task and two machines see the same prompts:
- `arithmetic`: "What is (7 + 5) * 3 - 4?"; a step-by-step trace in the think channel
  ("7 + 5 = 12. 12 * 3 = 36. 36 - 4 = 32."), the answer in the response. Difficulty is the number
  of operations, drawn from 1..max_level with P(k) ∝ k^-tail: tail 0 is uniform, tail ≈ 1.5 with a
  large max_level is the long-tailed length mix partial rollout is measured on (`LONG_TAIL`).
  Its brief trace (`Task.brief`, what a high-effort episode thinks) keeps each step's result alone.
- `strings`: reverse letters, sort numbers, count a letter, take the k-th word; difficulty is the
  length of the string or list (2 + level). The brief trace keeps the result without the steps.
- `tool`: the model must call a tool (the SFT tools of k3/tasks/tools.py) to learn a value no one can
  guess: a made-up fact from the bundled table (`lookup`) or a unit conversion (`convert`), then
  answer with it. Multi-turn: `continue_with_tool_results` runs the calls and gives the next
  turn's messages, up to `max_turns` assistant turns. The prompts reuse the SFT default set's
  phrasings, so an SFT model starts from a sensible policy.
- `shell`: file-system jobs (create a file, count matching lines into a file, rename .txt to .md) done
  with bash / read_file / write_file in the episode's own sandbox and judged by the files' end state
  (k3/tasks/shell.py); held out by the hash of the problem text, like arithmetic and strings.

Train vs held-out (both splits come from the same generator, then are filtered):
- arithmetic and strings: a problem (its canonical text, e.g. "arithmetic|(7 + 5) * 3 - 4") is
  held out when the SHA-256 of that text falls in the first HELDOUT_PERCENT of the range, so no
  held-out problem is ever a training problem, on any machine and for any seed;
- tool: the SFT default set's own split (`k3.tasks.default_set.item_split`): whole places and two
  whole unit pairs are held out, plus a hashed share of the conversions, and held-out prompts also
  use the SFT phrasings that training never sees. So an RL held-out tool task was held out of SFT
  too.
`Domain.heldout(n)` gives n distinct held-out problems (the evaluation set); `Domain.stream()`
the endless training stream.

Verifying. `Task.verify(replies)` takes the parsed replies of an episode (k3.text.xtml_parser's
`Reply`: reasoning, content, tool_calls, errors, complete), one per assistant turn, and returns a
`Score`. An episode counts as correct only when every turn parsed without errors and ended
properly (a reply cut off by the token limit is wrong), and the final answer equals the truth
exactly. The final answer is read from the last turn's response by one rule for all domains
(`final_answer`): the text after the last " is " or "=", trimmed of spaces and one trailing period,
so "14", "The answer is 14." and "3 km is 3000 m." give "14", "14" and "3000 m" (the SFT set's
phrasings pass; a list of guesses does not). The think channel is not graded: how long the model
thinks is the effort budget's business (k3/rl/effort.py), not correctness.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from k3.tasks import shell
from k3.tasks.default_set import ANSWERS, DEFAULT_N_TOOLS, REASONING, TEMPLATES, UNIT_PAIRS, WORDS, item_split
from k3.tasks.tools import FACTS, PLACES, TOOLS, UNITS, call_tool, lookup_key, parse_arguments
from k3.text.xtml import EFFORTS

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 20
# options for a long-tailed arithmetic mix: most problems take one or two steps, a few take a dozen
LONG_TAIL = {"max_level": 16, "tail": 1.5}
MAX_VALUE = 999  # arithmetic keeps every intermediate in 0..999, so numbers stay a token or two
HELDOUT_TRIES = 200  # draws per task before giving up on finding one of the wanted split
HELDOUT_STALL = 500  # held-out indices in a row with no new problem: the problem space is exhausted


class Reply(Protocol):
    """What verification reads of a parsed reply (k3.text.xtml_parser.Reply has these)."""
    content: str
    reasoning: str
    tool_calls: list[dict]  # OpenAI shape, the well-formed calls
    errors: list[str]  # what the parser could not make sense of; empty for a well-formed reply
    complete: bool  # ended at a stop token or closed its message (False: cut short)


@dataclass(frozen=True)
class Score:
    correct: bool
    reason: str  # "" when correct, else one line saying why not
    answer: str | None  # the final answer read from the last turn (None: there is none)
    well_formed: bool  # every turn parsed without errors and ended properly
    turns: int  # assistant turns in the episode
    tool_calls: int  # well-formed tool calls over all turns
    bad_calls: int  # calls whose result was an error or that were not the call the task needs
    reasoning_chars: int  # characters of reasoning over all turns
    content_chars: int  # characters of response over all turns


@dataclass(frozen=True)
class Task:
    id: str  # "<domain>/<split>/<index>/<options fingerprint>": unique across splits, seeds, options
    domain: str
    split: str
    index: int
    level: int  # difficulty (operations, list length, ...)
    messages: list[dict]  # the OpenAI-style prompt to render (copy before editing)
    tools: list[dict] | None  # tool declarations to offer, None when the domain offers none
    answer: str  # the ground truth the final answer must equal
    reference: list[dict]  # a correct episode after the prompt: assistant (and tool) messages
    max_turns: int  # assistant turns allowed in an episode
    expected_call: dict | None = None  # tool domain: {"tool": name, "arguments": {...}}
    item: str = field(default="", repr=False)  # the canonical problem text the split is decided on
    # the high-effort think trace: the reference's steps cut to what a shorter think keeps (None:
    # the reference trace at every level); cold-start SFT shows each effort its own length (DESIGN §13.2)
    brief: str | None = field(default=None, repr=False)
    kind: str = ""  # the sort of problem (strings: reverse / sort / count / nth; tool: the tool), per-kind accuracy
    # shell: {"files": {path: text}} the initial tree an episode's sandbox starts from (None elsewhere)
    setup: dict | None = field(default=None, repr=False)

    def verify(self, replies: Reply | Sequence[Reply]) -> Score:
        """Score an episode: its replies in turn order (or one reply for a one-turn episode)."""
        return DOMAINS[self.domain].verify(self, _as_list(replies))

    def tool_results(self, history: list[dict], calls: list[dict]) -> list[str]:
        """The results of one reply's `calls` after the episode's `history`, as the domain runs them."""
        return DOMAINS[self.domain].tool_results(self, history, calls)

    def reference_at(self, effort: str = "max") -> list[dict]:
        """The reference episode as an `effort` expert would write it: max keeps the full trace, high
        thinks the brief trace (when the domain has one), low answers without thinking."""
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {EFFORTS}, got {effort!r}")
        if effort == "max" or (effort == "high" and self.brief is None):
            return self.reference
        out = [dict(m) for m in self.reference]
        if effort == "high":
            out[0]["reasoning_content"] = self.brief
        else:
            for m in out:
                m.pop("reasoning_content", None)
        return out

    def render(self, xtml, messages: list[dict] | None = None, effort: str | None = "max"):
        """The prompt for the next turn in XTML (`messages`: the history so far, default the task's
        prompt), with thinking on at `effort` (low / high / max, the XTML effort message)."""
        return xtml.render(self.messages if messages is None else messages, tools=self.tools,
                           reasoning_effort=effort)


def _as_list(replies) -> list:
    if isinstance(replies, Sequence) and not isinstance(replies, (str, bytes)):
        return list(replies)
    return [replies]


def final_answer(content: str | None) -> str | None:
    """The answer in a response: after the last " is " or "=", trimmed of spaces and one trailing
    period; None when there is nothing there."""
    text = (content or "").strip()
    for sep in (" is ", "="):
        if sep in text:
            text = text.rsplit(sep, 1)[1].strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text or None


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def heldout_item(item: str) -> bool:
    """The value split of arithmetic and strings: a stable hash of the canonical problem text."""
    return _digest(f"k3-rl-split|{item}") % 100 < HELDOUT_PERCENT


def _counts(replies: list) -> dict:
    return {"well_formed": all(not r.errors and r.complete for r in replies), "turns": len(replies),
            "tool_calls": sum(len(r.tool_calls or ()) for r in replies),
            "reasoning_chars": sum(len(r.reasoning or "") for r in replies),
            "content_chars": sum(len(r.content or "") for r in replies)}


def _episode_problem(task: Task, replies: list) -> str:
    """Why an episode cannot count, whatever its answer ("" when nothing is wrong with its form)."""
    if not replies:
        return "no reply"
    if len(replies) > task.max_turns:
        return f"{len(replies)} turns, the domain allows {task.max_turns}"
    return _malformed(replies)


def _malformed(replies: list) -> str:
    for n, r in enumerate(replies, 1):
        if r.errors:
            return f"turn {n} is malformed: {r.errors[0]}"
        if not r.complete:
            return f"turn {n} was cut off before its end"
    return ""


class Domain:
    """One verifiable domain. `max_level` bounds the difficulty, drawn with P(k) ∝ k^-tail."""
    name = ""
    agentic = False  # True: the effort budget counts all generated tokens, else think tokens (DESIGN §13.2)
    max_turns = 1
    default_max_level = 3

    def __init__(self, seed: int = 0, max_level: int | None = None, tail: float = 0.0):
        max_level = self.default_max_level if max_level is None else max_level
        if isinstance(max_level, bool) or not isinstance(max_level, int) or max_level < 1:
            raise ValueError(f"{self.name}: max_level must be an integer >= 1, got {max_level!r}")
        if isinstance(tail, bool) or not (isinstance(tail, (int, float)) and math.isfinite(tail) and tail >= 0):
            raise ValueError(f"{self.name}: tail must be a finite number >= 0, got {tail!r}")
        self.seed, self.max_level, self.tail = int(seed), max_level, float(tail)
        self._weights = [k ** -self.tail for k in range(1, max_level + 1)]
        self.fingerprint = f"{_digest(json.dumps(self.options(), sort_keys=True)):016x}"[:8]

    def options(self) -> dict:
        return {"domain": self.name, "seed": self.seed, "max_level": self.max_level, "tail": self.tail}

    # ---- generation

    def _rng(self, split: str, index: int, attempt: int) -> random.Random:
        return random.Random(_digest(f"k3-rl|{self.name}|{self.seed}|{self.fingerprint}|{split}|{index}|{attempt}"))

    def level(self, rng: random.Random) -> int:
        return rng.choices(range(1, self.max_level + 1), self._weights)[0]

    def task(self, split: str, index: int) -> Task:
        """Task `index` of `split`, the same for the same domain options on every machine."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be an integer >= 0, got {index!r}")
        for attempt in range(HELDOUT_TRIES):
            rng = self._rng(split, index, attempt)
            parts = self._draw(rng, self.level(rng))
            if self._split(parts) == split:
                return self._task(split, index, parts, rng)
        raise RuntimeError(f"{self.name}: no {split} problem in {HELDOUT_TRIES} draws (options {self.options()})")

    def stream(self, split: str = "train", start: int = 0) -> Iterator[Task]:
        """Tasks start, start + 1, ... of `split`, without end."""
        index = start
        while True:
            yield self.task(split, index)
            index += 1

    def tasks(self, split: str, n: int, start: int = 0) -> list[Task]:
        return [self.task(split, i) for i in range(start, start + n)]

    def heldout(self, n: int) -> list[Task]:
        """`n` distinct held-out problems (the evaluation set): the held-out stream, repeats skipped."""
        seen: set[str] = set()
        out: list[Task] = []
        index = last_new = 0
        while len(out) < n and index - last_new < HELDOUT_STALL:
            t = self.task("heldout", index)
            if t.item not in seen:
                seen.add(t.item)
                out.append(t)
                last_new = index
            index += 1
        if len(out) < n:
            raise ValueError(f"{self.name}: only {len(out)} distinct held-out problems with options "
                             f"{self.options()}, {n} asked (raise max_level)")
        return out

    def _split(self, parts: dict) -> str:
        return "heldout" if heldout_item(parts["item"]) else "train"

    def _draw(self, rng: random.Random, level: int) -> dict:
        raise NotImplementedError

    def _task(self, split: str, index: int, parts: dict, rng: random.Random) -> Task:
        raise NotImplementedError

    def _make(self, split, index, parts, messages, reference, tools=None, expected_call=None, setup=None) -> Task:
        return Task(setup=setup, id=f"{self.name}/{split}/{index}/{self.fingerprint}", domain=self.name, split=split, index=index,
                    level=parts["level"], messages=messages, tools=tools, answer=parts["answer"],
                    reference=reference, max_turns=self.max_turns, expected_call=expected_call, item=parts["item"],
                    brief=parts.get("brief"), kind=parts["kind"])

    # ---- tools

    def tool_results(self, task: Task, history: list[dict], calls: list[dict]) -> list[str]:
        """The results of one reply's `calls`, after the episode's `history` (the tool domain's: the
        default tools, run in-process)."""
        return [call_tool((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in calls]

    # ---- verification

    def verify(self, task: Task, replies: list) -> Score:
        """One-turn domains: a well-formed reply whose final answer equals the truth."""
        counts = _counts(replies)
        answer = final_answer(replies[-1].content) if replies else None
        reason = _episode_problem(task, replies)
        if not reason:
            if counts["tool_calls"]:
                reason = "called a tool, the domain offers none"
            elif answer is None:
                reason = "no answer in the response"
            elif answer != task.answer:
                reason = f"answered {answer!r}, want {task.answer!r}"
        return Score(correct=not reason, reason=reason, answer=answer, bad_calls=counts["tool_calls"], **counts)


class Arithmetic(Domain):
    """Left-to-right chains of + - * over small numbers, every intermediate in 0..MAX_VALUE."""
    name = "arithmetic"
    default_max_level = 3

    def __init__(self, seed: int = 0, max_level: int | None = None, tail: float = 0.0, digits: int = 1):
        if isinstance(digits, bool) or digits not in (1, 2):
            raise ValueError(f"arithmetic: digits must be 1 or 2, got {digits!r}")
        self.digits = digits
        super().__init__(seed, max_level, tail)

    def options(self) -> dict:
        return {**super().options(), "digits": self.digits}

    def _draw(self, rng: random.Random, level: int) -> dict:
        lo, hi = (2, 9) if self.digits == 1 else (10, 99)
        value = rng.randint(lo, hi)
        text, top = str(value), ""  # `top`: the expression's outermost operator
        steps, results_only = [], []
        for _ in range(level):
            b = rng.randint(lo, hi)
            results = {"+": value + b, "-": value - b, "*": value * b}
            # never empty: + overflows only above 900, where - of a b <= 99 stays >= 0
            op = rng.choice([op for op, r in results.items() if 0 <= r <= MAX_VALUE])
            new = results[op]
            # left-to-right evaluation: a sum or difference multiplied needs its parentheses
            text = f"({text}) * {b}" if op == "*" and top in ("+", "-") else f"{text} {op} {b}"
            top = op
            steps.append(f"{value} {op} {b} = {new}.")
            results_only.append(f"{new}.")
            value = new
        # brief: each step's result without its operands ("12. 36. 32.")
        return {"level": level, "expression": text, "answer": str(value), "trace": " ".join(steps),
                "brief": " ".join(results_only), "item": f"arithmetic|{text}", "kind": f"{level}-step"}

    def _task(self, split, index, parts, rng) -> Task:
        messages = [{"role": "user", "content": f"What is {parts['expression']}?"}]
        reference = [{"role": "assistant", "reasoning_content": parts["trace"], "content": parts["answer"]}]
        return self._make(split, index, parts, messages, reference)


LETTERS = "abcdefghiklmnoprstu"  # no j/q/v/w/x/y/z: rarer letters merge worst in a small BPE


class Strings(Domain):
    """String and list manipulation: reverse letters, sort numbers, count a letter, the k-th word."""
    name = "strings"
    default_max_level = 3
    KINDS = ("reverse", "sort", "count", "nth")

    def _draw(self, rng: random.Random, level: int) -> dict:
        n = 2 + level
        kind = rng.choice(self.KINDS)
        if kind == "reverse":
            s = "".join(rng.choice(LETTERS) for _ in range(n))
            prompt, answer = f"Reverse the letters: {s}", s[::-1]
            trace = f"{' '.join(s)} backwards is {' '.join(answer)}."
        elif kind == "sort":
            xs = rng.sample(range(1, 100), n)
            answer = " ".join(map(str, sorted(xs)))
            prompt, trace = f"Sort: {' '.join(map(str, xs))}", f"{' < '.join(map(str, sorted(xs)))}."
        elif kind == "count":
            letter = rng.choice(LETTERS[:6])
            # the wanted letter at a random share of the places, so counts 0..n all occur
            share = rng.random()
            s = "".join(letter if rng.random() < share else rng.choice(LETTERS) for _ in range(n))
            hits = [str(i) for i, c in enumerate(s, 1) if c == letter]
            answer = str(len(hits))
            prompt = f"Count the letter {letter} in: {s}"
            trace = f"{letter} at {', '.join(hits)}: {answer}." if hits else f"no {letter}: 0."
        else:
            words = rng.sample(WORDS, n)
            k = rng.randint(1, n)
            answer = words[k - 1]
            prompt = f"Word {k} of: {' '.join(words)}"
            trace = f"{', '.join(f'{i} {w}' for i, w in enumerate(words[:k], 1))}."
        # brief: the result alone, reversed letters spaced as the trace spaces them
        brief = f"{' '.join(answer) if kind == 'reverse' else answer}."
        return {"level": level, "prompt": prompt, "answer": answer, "trace": trace, "brief": brief,
                "item": f"strings|{prompt}", "kind": kind}

    def _task(self, split, index, parts, rng) -> Task:
        messages = [{"role": "user", "content": parts["prompt"]}]
        reference = [{"role": "assistant", "reasoning_content": parts["trace"], "content": parts["answer"]}]
        return self._make(split, index, parts, messages, reference)


def _canonical_arguments(tool: str, args) -> tuple | None:
    """A call's arguments as the tool reads them (None when they are not an object): lookup keys
    compare as the table does (case and spacing folded), numbers by value."""
    if not isinstance(args, dict):
        return None
    if tool == "lookup":
        key = args.get("key")
        return ("lookup", " ".join(key.split()).lower()) if isinstance(key, str) and len(args) == 1 else None
    if tool == "convert":
        value = args.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or set(args) != {"value", "from", "to"}:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return "convert", Fraction(repr(value)) if isinstance(value, float) else Fraction(value), args["from"], args["to"]
    return None


class ToolUse(Domain):
    """Call the tool that knows the value (lookup in the bundled table, or convert), then answer it."""
    name = "tool"
    agentic = True
    max_turns = 3  # the call, its answer, and one retry after a bad call
    default_max_level = 1  # one call per task: the level is recorded, it does not change the task
    KINDS = ("lookup", "convert")

    def __init__(self, seed: int = 0, max_level: int | None = None, tail: float = 0.0,
                 n_tools: int = DEFAULT_N_TOOLS):
        if isinstance(n_tools, bool) or not isinstance(n_tools, int) or not 1 <= n_tools <= len(TOOLS):
            raise ValueError(f"tool: n_tools must be in 1..{len(TOOLS)}, got {n_tools!r}")
        self.n_tools = n_tools
        super().__init__(seed, max_level, tail)

    def options(self) -> dict:
        return {**super().options(), "n_tools": self.n_tools}

    def _draw(self, rng: random.Random, level: int) -> dict:
        kind = rng.choice(self.KINDS)
        if kind == "lookup":
            args = {"key": lookup_key(rng.choice(FACTS), rng.choice(PLACES))}
        else:
            a, b = rng.choice(UNIT_PAIRS)
            up = UNITS[b][1] / UNITS[a][1]  # how many `a` make one `b`
            # into a bigger unit, a whole multiple of it, so every answer is a whole number
            value = rng.randint(1, 20) * int(up) if up > 1 else rng.randint(1, 99 if up >= Fraction(1, 1000) else 9)
            args = {"value": value, "from": a, "to": b}
        answer = call_tool(kind, args)
        if answer.startswith("error:"):
            raise AssertionError(f"tool domain item {kind} {args} fails: {answer}")  # a generator bug
        return {"level": level, "kind": kind, "arguments": args, "answer": answer,
                "item": f"tool|{kind}|{json.dumps(args, sort_keys=True)}"}

    def _split(self, parts: dict) -> str:
        return item_split(parts["kind"], parts["arguments"])  # the SFT default set's split

    def _task(self, split, index, parts, rng) -> Task:
        kind, args = parts["kind"], parts["arguments"]
        templates = [t for t, heldout_only in TEMPLATES[kind] if split == "heldout" or not heldout_only]
        messages = [{"role": "user", "content": rng.choice(templates).format(**args)}]
        others = [t["function"]["name"] for t in TOOLS if t["function"]["name"] != kind]
        names = {kind, *rng.sample(others, self.n_tools - 1)}
        tools = [copy.deepcopy(t) for t in TOOLS if t["function"]["name"] in names]
        call = {"id": f"functions.{kind}:1", "type": "function",
                "function": {"name": kind, "arguments": json.dumps(args)}}
        reference = [
            {"role": "assistant", "reasoning_content": REASONING[kind].format(**args), "content": None,
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": parts["answer"]},
            {"role": "assistant", "content": ANSWERS[kind].format(result=parts["answer"], **args)},
        ]
        return self._make(split, index, parts, messages, reference, tools=tools,
                          expected_call={"tool": kind, "arguments": dict(args)})

    def verify(self, task: Task, replies: list) -> Score:
        """Correct: well-formed turns, the needed tool called with the needed arguments (as the tool
        reads them), and the last turn, which calls nothing, answering exactly the tool's result."""
        counts = _counts(replies)
        calls = [c for r in replies for c in (r.tool_calls or ())]
        want = _canonical_arguments(task.expected_call["tool"], task.expected_call["arguments"])
        right = 0
        for c in calls:
            fn = c.get("function") or {}
            try:
                args = parse_arguments(fn.get("arguments"))
            except ValueError:
                continue
            if fn.get("name") == task.expected_call["tool"] and _canonical_arguments(fn.get("name"), args) == want \
                    and not call_tool(fn["name"], args).startswith("error:"):
                right += 1
        answer = final_answer(replies[-1].content) if replies else None
        reason = _episode_problem(task, replies)
        if not reason:
            if replies[-1].tool_calls:
                reason = "the episode ended on a tool call, with no final answer"
            elif not calls:
                reason = "no tool was called"
            elif not right:
                reason = f"never called {task.expected_call['tool']} with {json.dumps(task.expected_call['arguments'])}"
            elif answer is None:
                reason = "no answer in the final response"
            elif answer != task.answer:
                reason = f"answered {answer!r}, the tool gave {task.answer!r}"
        return Score(correct=not reason, reason=reason, answer=answer, bad_calls=len(calls) - right, **counts)


def continue_with_tool_results(task, reply: Reply, messages: list[dict] | None = None) -> list[dict]:
    """The next turn's messages: the history (default: the task's prompt), the reply as an assistant
    message (its reasoning kept: K3 trains and serves with the thinking history, DESIGN §13.1), and
    each call's result by `task.tool_results` (an "error: ..." result for a bad call, so the model can
    retry). `task`: a `Task`, or any episode task (k3/tasks/episodes.py)."""
    if not reply.tool_calls:
        raise ValueError(f"{task.id}: the reply calls no tool, there is no tool result to continue with")
    history = [dict(m) for m in (task.messages if messages is None else messages)]
    turn = {"role": "assistant", "content": reply.content or None, "tool_calls": copy.deepcopy(list(reply.tool_calls))}
    if reply.reasoning:
        turn["reasoning_content"] = reply.reasoning
    results = task.tool_results(history, list(reply.tool_calls))
    history.append(turn)
    for call, content in zip(reply.tool_calls, results):
        result = {"role": "tool", "content": content}
        if call.get("id") is not None:
            result["tool_call_id"] = call["id"]
        history.append(result)
    return history


def needs_another_turn(task, reply: Reply, turns_done: int) -> bool:
    """Whether an episode goes on after its `turns_done`-th reply: it called a tool and turns remain."""
    return bool(reply.tool_calls) and turns_done < task.max_turns


def _calls_in(task: Task, history: list[dict]) -> list[dict]:
    """The tool calls the assistant turns of `history` made after the task's prompt, in order."""
    return [c for m in history[len(task.messages):] if m.get("role") == "assistant" for c in (m.get("tool_calls") or ())]


class Shell(Domain):
    """File-system jobs done with bash / read_file / write_file in the episode's own sandbox, judged
    by the end state of the files (k3/tasks/shell.py)."""
    name = "shell"
    agentic = True
    max_turns = 6
    default_max_level = 3
    KINDS = shell.KINDS

    def _draw(self, rng: random.Random, level: int) -> dict:
        return shell.draw(rng, level)

    def _task(self, split, index, parts, rng) -> Task:
        messages = [{"role": "user", "content": parts["prompt"]}]
        return self._make(split, index, parts, messages, shell.reference(parts), tools=copy.deepcopy(shell.TOOLS),
                          setup={"files": dict(parts["files"])})

    def tool_results(self, task: Task, history: list[dict], calls: list[dict]) -> list[str]:
        """Run the calls in the episode's sandbox (the one that ran `history`'s calls), kept for the next turn."""
        before = _calls_in(task, history)
        ep = shell.take_episode(task, before)
        try:
            results = ep.run_calls(calls)
        except BaseException:
            ep.close()
            raise
        shell.keep_episode(ep, before + list(calls))
        return results

    def verify(self, task: Task, replies: list) -> Score:
        """Correct: well-formed turns, the last one calling no tool, and the end state of the files
        right (judged on a fork of the episode's sandbox, which is then closed)."""
        counts = _counts(replies)
        reason = _episode_problem(task, replies)
        ran = [c for r in replies[:-1] for c in (r.tool_calls or ())]  # the last turn's calls never ran
        if not reason and replies[-1].tool_calls:
            reason = "the episode ended on a tool call, not with a final response"
        if reason:
            shell.drop_episode(task, ran)
        else:
            with shell.take_episode(task, ran) as ep:
                reason = ep.judge()
        bad = sum(isinstance(shell.checked_arguments(fn.get("name"), fn.get("arguments")), str)
                  for fn in ((c.get("function") or {}) for r in replies for c in (r.tool_calls or ())))
        return Score(correct=not reason, reason=reason, answer=None, bad_calls=bad, **counts)


DOMAINS: dict[str, Domain] = {}  # name -> the default instance, which verifies any of the domain's tasks
DOMAIN_CLASSES = {cls.name: cls for cls in (Arithmetic, Strings, ToolUse, Shell)}
DOMAINS.update({name: cls() for name, cls in DOMAIN_CLASSES.items()})


def make_domain(name: str, seed: int = 0, **options) -> Domain:
    """A domain by name: arithmetic / strings / tool / shell, with its options (max_level, tail, and
    digits for arithmetic, n_tools for tool)."""
    if name not in DOMAIN_CLASSES:
        raise ValueError(f"unknown domain {name!r} (known: {', '.join(DOMAIN_CLASSES)})")
    return DOMAIN_CLASSES[name](seed=seed, **options)
