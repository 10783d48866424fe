"""The embedded default SFT set: tool use and plain answers, generated procedurally (no downloads).

Written for the model it trains: k3-tiny (hidden 128, a 4096-token BPE learnt on Shakespeare), with a
few minutes of CPU. So conversations are short, phrased the same way every time, and every piece of
a reply can be COPIED from earlier in the conversation, which small transformers learn quickly.
What the set controls of the length is mostly the tool declarations: JSON barely merges in this
BPE (~1.7 bytes per token), so one declaration costs ~140 tokens, and a conversation declares
`n_tools` of the three (default 2: the one it needs and a distractor, so that choosing the tool is
still a choice). Rendered in XTML that is ~680 tokens a conversation (at most ~800): ~190 of fixed
system messages (thinking effort, tools header), ~280 of declarations, ~210 of the conversation
itself, ~115 of them assistant tokens that carry the loss; n_tools=1 makes it ~540. The kinds:
- tool use (~70%): the user asks; the assistant reasons in one fixed sentence that repeats the
  argument, calls the tool with arguments copied from the question, gets the tool result, and
  answers in a fixed phrasing that copies the result ("The answer is 84.", "The colour of Bosk is
  pink.", "3 km is 3000 m.");
- plain answers (~30%): "repeat these words" copy tasks (one fixed reasoning sentence, "No tool is
  needed. ...") and greetings, which have no reasoning at all (nothing to think about; XTML renders
  an empty think channel). Tools stay declared, so the model learns when not to call one.
Numbers are small (two-digit operands, results of a few digits); lookups are made-up facts
(k3/tasks/tools.py), so only the tool knows them. Values are many (1,000 places, 20 unit pairs, ~30k
expressions), so that a model cannot fit the training set by naming values it memorized and the
held-out split measures copying.

Held-out split, by template and by value:
- templates: every kind has phrasings used only by "heldout" (train never sees them; heldout uses
  all phrasings, so it measures both the seen and the unseen wording);
- values: an item (an expression, a lookup place, a conversion, a word sequence) belongs to heldout
  when the SHA-256 of its text falls in the first HELDOUT_PERCENT of the range; whole places and
  three whole unit pairs are held out, but their table entries and units exist, so every held-out
  call can be answered by copying.
Every conversation carries `expected` = {"tool", "arguments", "answer"} (tool None for plain
answers): what scoring a model's replies needs (k3/tasks/scoring.py).
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path

from k3.atomic import write_text_atomic
from k3.tasks.conversations import Conversation, parse_conversation
from k3.tasks.tools import FACTS, PLACES, TOOLS, UNITS, call_tool, lookup_key

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 20
CALL_ID = "call_1"
# tools declared per conversation: each declaration costs ~140 tokens (JSON barely merges in a Shakespeare
# BPE); two keep the choice of tool a real one at ~2/3 of the cost of all three
DEFAULT_N_TOOLS = 2

# (template, held-out only); the placeholders are the item's parts
TEMPLATES: dict[str, list[tuple[str, bool]]] = {
    "calculator": [("What is {expression}?", False), ("Compute {expression}.", False),
                   ("Calculate {expression}, please.", False), ("What does {expression} equal?", False),
                   ("How much is {expression}?", True), ("Please work out {expression}.", True)],
    "lookup": [("What is the {key}?", False), ("Tell me the {key}.", False), ("Look up the {key}.", False),
               ("Do you know the {key}?", True), ("I need the {key}.", True)],
    "convert": [("Convert {value} {from} to {to}.", False), ("How many {to} is {value} {from}?", False),
                ("What is {value} {from} in {to}?", False),
                ("Change {value} {from} into {to}.", True), ("Please turn {value} {from} into {to}.", True)],
    "repeat": [("Repeat after me: {words}", False), ("Say this back: {words}", False), ("Echo: {words}", False),
               ("Please repeat: {words}", True), ("Copy these words: {words}", True)],
    "greeting": [("Hello!", False), ("Hi there.", False), ("Good morning!", False), ("Hey!", False),
                 ("Good evening!", True), ("Hello there!", True)],
}
KINDS = {"calculator": 25, "lookup": 25, "convert": 20, "repeat": 20, "greeting": 10}  # relative shares

REASONING = {
    "calculator": "I will use calculator for {expression}.",
    "lookup": "I will use lookup for {key}.",
    "convert": "I will use convert for {value} {from} to {to}.",
    "repeat": "No tool is needed. I will repeat the words.",
}
ANSWERS = {
    "calculator": "The answer is {result}.",
    "lookup": "The {key} is {result}.",
    "convert": "{value} {from} is {result}.",
    "repeat": "{words}",
    "greeting": "Hello! How can I help you?",
}
GREETING_ANSWER = "How can I help you?"

# unit pairs asked about (from, to); the held-out ones are only ever asked in heldout
# (a set too small to learn the pairs by heart: the units are copied from the question)
UNIT_PAIRS = [("km", "m"), ("m", "km"), ("m", "cm"), ("cm", "m"), ("cm", "mm"), ("mm", "cm"), ("m", "mm"),
              ("mm", "m"), ("km", "cm"), ("kg", "g"), ("g", "kg"), ("g", "mg"), ("mg", "g"),
              ("days", "hours"), ("hours", "days"), ("hours", "minutes"), ("minutes", "hours"),
              ("minutes", "seconds"), ("seconds", "minutes"), ("hours", "seconds")]
HELDOUT_PAIRS = {("cm", "m"), ("hours", "seconds"), ("mg", "g")}
WORDS = ("red", "blue", "green", "apple", "river", "stone", "cloud", "bird", "tree", "moon", "sun", "star",
         "fish", "boat", "door", "lamp", "book", "cat", "dog", "horse", "king", "queen", "rose", "wind",
         "fire", "snow", "rain", "bell", "ring", "gold", "bread", "milk", "hill", "sea", "road", "key")


def heldout_item(item: str) -> bool:
    """The value split: a stable hash of the item's text, the same on every machine."""
    return int.from_bytes(hashlib.sha256(f"k3-sft-split|{item}".encode()).digest()[:8], "big") % 100 \
        < HELDOUT_PERCENT


def place_split(place: str) -> str:
    return "heldout" if heldout_item(f"place|{place}") else "train"


def item_split(kind: str, parts: dict) -> str:
    """Which split a tool or copy item belongs to (greetings have no value: either split)."""
    if kind == "lookup":
        return place_split(parts["key"].rsplit(" of ", 1)[1])
    if kind == "convert":
        if (parts["from"], parts["to"]) in HELDOUT_PAIRS:
            return "heldout"
        return "heldout" if heldout_item(f"convert|{parts['value']} {parts['from']} {parts['to']}") else "train"
    if kind == "calculator":
        return "heldout" if heldout_item(f"calculator|{parts['expression']}") else "train"
    if kind == "repeat":
        return "heldout" if heldout_item(f"repeat|{parts['words']}") else "train"
    raise ValueError(f"no value split for kind {kind!r}")


def _draw(kind: str, rng: random.Random) -> dict:
    """One candidate item of `kind` (either split)."""
    if kind == "calculator":
        if rng.random() < 0.25:  # a few three-operand expressions
            a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 20)
            op1, op2 = rng.choice("+-*"), rng.choice("+*")
            return {"expression": rng.choice([f"{a} {op1} {b} {op2} {c}", f"({a} {op1} {b}) {op2} {c}"])}
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        if op == "-" and a < b:
            a, b = b, a
        return {"expression": f"{a} {op} {b}"}
    if kind == "lookup":
        return {"key": lookup_key(rng.choice(FACTS), rng.choice(PLACES))}
    if kind == "convert":
        a, b = rng.choice(UNIT_PAIRS)
        fa, fb = UNITS[a][1], UNITS[b][1]
        # going to a bigger unit, ask about a whole multiple so that every result is a small integer
        value = rng.randint(1, 20) * int(fb / fa) if fb > fa else rng.randint(1, 99 if fa / fb <= 1000 else 9)
        return {"value": value, "from": a, "to": b}
    if kind == "repeat":
        return {"words": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))}
    return {}


def _conversation(kind: str, parts: dict, template: str, tools: list[dict]) -> dict:
    user = {"role": "user", "content": template.format(**parts)}
    if kind == "greeting":
        answer = ANSWERS[kind]
        return {"messages": [user, {"role": "assistant", "content": answer}], "tools": tools,
                "expected": {"tool": None, "arguments": None, "answer": GREETING_ANSWER}}
    if kind == "repeat":
        reply = {"role": "assistant", "reasoning_content": REASONING[kind], "content": parts["words"]}
        return {"messages": [user, reply], "tools": tools,
                "expected": {"tool": None, "arguments": None, "answer": parts["words"]}}
    args = dict(parts)  # every default tool's arguments are exactly its item's parts
    result = call_tool(kind, args)
    if result.startswith("error:"):
        raise AssertionError(f"default set item {kind} {args} fails: {result}")  # a generator bug
    call = {"id": CALL_ID, "type": "function", "function": {"name": kind, "arguments": json.dumps(args)}}
    messages = [
        user,
        {"role": "assistant", "reasoning_content": REASONING[kind].format(**parts), "content": None,
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": result},
        {"role": "assistant", "content": ANSWERS[kind].format(result=result, **parts)},
    ]
    return {"messages": messages, "tools": tools, "expected": {"tool": kind, "arguments": args, "answer": result}}


def _rng(split: str, seed: int) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"k3-sft|{split}|{seed}".encode()).digest()[:8], "big"))


def _declared(kind: str, n_tools: int, rng: random.Random) -> list[dict]:
    """`n_tools` of the tools, in TOOLS order, always including the one the conversation calls."""
    names = [t["function"]["name"] for t in TOOLS]
    needed = [kind] if kind in names else []
    chosen = set(needed + rng.sample([m for m in names if m not in needed], n_tools - len(needed)))
    return [copy.deepcopy(t) for t in TOOLS if t["function"]["name"] in chosen]  # callers may edit theirs


def conversations(split: str, n: int, seed: int = 0, n_tools: int = DEFAULT_N_TOOLS) -> list[dict]:
    """`n` conversations of `split` ("train" or "heldout"), the same for the same arguments.
    Each declares `n_tools` of the tools (1..3): the one it calls, if any, and random others."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= n_tools <= len(TOOLS):
        raise ValueError(f"n_tools must be in 1..{len(TOOLS)}, got {n_tools}")
    rng = _rng(split, seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    out = []
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        templates = [t for t, heldout_only in TEMPLATES[kind] if split == "heldout" or not heldout_only]
        template = rng.choice(templates)
        parts = _draw(kind, rng)
        while kind != "greeting" and item_split(kind, parts) != split:
            parts = _draw(kind, rng)
        out.append(_conversation(kind, parts, template, _declared(kind, n_tools, rng)))
    return out


def load(split: str, n: int, seed: int = 0, n_tools: int = DEFAULT_N_TOOLS) -> list[Conversation]:
    """`conversations(...)` as checked dataset Conversations (source "default-set:<split>", line = position)."""
    return [parse_conversation(c, i, f"default-set:{split}")
            for i, c in enumerate(conversations(split, n, seed, n_tools), 1)]


def write_jsonl(path: str | Path, convs: list[dict]) -> Path:
    """One conversation per line, written whole or not at all."""
    return write_text_atomic(path, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
