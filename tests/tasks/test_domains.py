"""Verifiable RL domains (k3/tasks/domains.py): determinism, train/held-out disjointness, verifiers on
correct / wrong / malformed / missing replies, XTML render -> parse round trips, the tool domain's
multi-turn episode, and the long-tail difficulty knob."""
from __future__ import annotations

import json
import re
import statistics
from functools import lru_cache

import pytest

from k3.tasks.default_set import HELDOUT_PAIRS, TEMPLATES, place_split
from k3.tasks.domains import (
    DOMAINS,
    LONG_TAIL,
    SPLITS,
    continue_with_tool_results,
    final_answer,
    heldout_item,
    make_domain,
    needs_another_turn,
)
from k3.tasks.tools import PLACES
from k3.text.tokenizer import train_tokenizer
from k3.text.xtml import XTML
from k3.text.xtml_parser import Reply

NAMES = tuple(DOMAINS)


@lru_cache(maxsize=1)
def xtml() -> XTML:
    """A small BPE learnt on the domains' own text (tokenization only matters for round trips)."""
    texts = []
    for name in NAMES:
        for t in make_domain(name).tasks("train", 60):
            texts += [t.messages[0]["content"], json.dumps(t.reference)]
    return XTML(train_tokenizer(texts, 400))


def reply(content="", reasoning="", tool_calls=(), errors=(), complete=True) -> Reply:
    return Reply(content=content, reasoning=reasoning, tool_calls=list(tool_calls), errors=list(errors),
                 complete=complete)


def call(name: str, arguments: dict | str, n: int = 1) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"functions.{name}:{n}", "type": "function", "function": {"name": name, "arguments": args}}


def reference_replies(task) -> list[Reply]:
    """The task's reference episode as the parser would return its assistant turns."""
    return [reply(m.get("content") or "", m.get("reasoning_content") or "", m.get("tool_calls") or ())
            for m in task.reference if m["role"] == "assistant"]


# ---------------------------------------------------------------- generation

@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name):
    a, b = make_domain(name, seed=3).tasks("train", 20), make_domain(name, seed=3).tasks("train", 20)
    assert [(t.id, t.messages, t.tools, t.answer, t.reference) for t in a] == \
           [(t.id, t.messages, t.tools, t.answer, t.reference) for t in b]
    d = make_domain(name, seed=3)
    assert d.task("train", 7) == a[7]  # random access: a resumed run asks for index 7 directly
    assert next(d.stream("train", start=5)) == a[5]
    other = make_domain(name, seed=4).tasks("train", 20)
    assert {t.id for t in other}.isdisjoint(t.id for t in a)  # ids carry the options fingerprint
    if name != "tool":  # the tool domain's item space is small: seeds may coincide on items, not on all
        assert [t.item for t in other] != [t.item for t in a]


@pytest.mark.parametrize("name", NAMES)
def test_heldout_disjoint_from_train(name):
    d = make_domain(name)
    train = d.tasks("train", 1500)
    held = d.heldout(40)
    assert len({t.item for t in held}) == 40 and all(t.split == "heldout" for t in held)
    assert {t.item for t in train}.isdisjoint(t.item for t in held)
    assert len({t.id for t in train} | {t.id for t in held}) == len(train) + len(held)
    if name != "tool":
        assert not any(heldout_item(t.item) for t in train) and all(heldout_item(t.item) for t in held)


def test_tool_heldout_follows_the_sft_split():
    d = make_domain("tool")
    train, held = d.tasks("train", 400), d.heldout(60)
    for t in train:
        args = t.expected_call["arguments"]
        if t.expected_call["tool"] == "lookup":
            assert place_split(args["key"].rsplit(" of ", 1)[1]) == "train"
        else:
            assert (args["from"], args["to"]) not in HELDOUT_PAIRS
    held_only = {tmpl.split("{")[0] for kind in ("lookup", "convert") for tmpl, h in TEMPLATES[kind] if h}
    assert not any(t.messages[0]["content"].startswith(tuple(held_only)) for t in train)
    assert any(t.messages[0]["content"].startswith(tuple(held_only)) for t in held)  # unseen phrasings
    assert {p for p in PLACES if place_split(p) == "heldout"} & {
        t.expected_call["arguments"]["key"].rsplit(" of ", 1)[1] for t in held if t.expected_call["tool"] == "lookup"}


def test_task_contents():
    a = make_domain("arithmetic").task("train", 1)
    assert a.tools is None and a.max_turns == 1 and a.messages[0]["role"] == "user"
    assert a.messages[0]["content"] == "What is (7 + 3) * 2 + 8?" and a.answer == "28"
    assert a.reference[0]["reasoning_content"] == "7 + 3 = 10. 10 * 2 = 20. 20 + 8 = 28."
    t = make_domain("tool").task("train", 1)
    assert t.max_turns == 3 and t.expected_call["tool"] in [x["function"]["name"] for x in t.tools]
    assert len(t.tools) == 2 and len(make_domain("tool", n_tools=1).task("train", 1).tools) == 1
    for name in NAMES:  # short prompts for a tiny model
        assert all(len(x.messages[0]["content"]) < 80 for x in make_domain(name).tasks("train", 100))


def test_arithmetic_answers_are_the_expression_values():
    for t in make_domain("arithmetic", **LONG_TAIL).tasks("train", 300):
        expression = t.messages[0]["content"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expression)) == t.answer  # the generated text means what the trace computes
        assert t.reference[0]["reasoning_content"].count("=") == t.level


def test_bad_options():
    with pytest.raises(ValueError, match="unknown domain"):
        make_domain("chess")
    with pytest.raises(ValueError, match="max_level"):
        make_domain("arithmetic", max_level=0)
    with pytest.raises(ValueError, match="tail"):
        make_domain("strings", tail=-1.0)
    with pytest.raises(ValueError, match="split"):
        make_domain("strings").task("test", 0)
    with pytest.raises(ValueError, match="n_tools"):
        make_domain("tool", n_tools=4)
    with pytest.raises(ValueError, match="distinct held-out"):
        make_domain("arithmetic", max_level=1).heldout(10_000)
    assert SPLITS == ("train", "heldout")


# ---------------------------------------------------------------- verification

def test_final_answer():
    assert final_answer("14") == "14" and final_answer(" The answer is 14. ") == "14"
    assert final_answer("3 km is 3000 m.") == "3000 m" and final_answer("(2 + 3) * 4 = 20") == "20"
    assert final_answer("") is None and final_answer(None) is None and final_answer("The answer is .") is None


@pytest.mark.parametrize("name", ["arithmetic", "strings"])
def test_one_turn_verifier(name):
    for t in make_domain(name).tasks("heldout", 30):
        good = reference_replies(t)
        assert t.verify(good).correct and t.verify(good[0]).correct
        assert t.verify(reply(f"The answer is {t.answer}.")).correct  # no reasoning needed to be right
        s = t.verify(reply(t.answer + "0", "x"))
        assert not s.correct and "answered" in s.reason and s.reasoning_chars == 1
        assert not t.verify(reply(f"{t.answer} {t.answer}9")).correct
        assert "no answer" in t.verify(reply("")).reason
        assert "malformed" in t.verify(reply(t.answer, errors=["unexpected <foo> element"])).reason
        assert "cut off" in t.verify(reply(t.answer, complete=False)).reason
        assert "no reply" in t.verify([]).reason
        assert "turns" in t.verify(good + good).reason
        assert "offers none" in t.verify(reply(t.answer, tool_calls=[call("lookup", {"key": "x"})])).reason


def test_tool_verifier():
    t = next(x for x in make_domain("tool").tasks("train", 50) if x.expected_call["tool"] == "lookup")
    key, truth = t.expected_call["arguments"]["key"], t.answer
    first, final = reference_replies(t)
    s = t.verify([first, final])
    assert s.correct and s.tool_calls == 1 and s.bad_calls == 0 and s.turns == 2 and s.answer == truth
    # the table folds case and spacing, so the verifier does too
    assert t.verify([reply(tool_calls=[call("lookup", {"key": key.upper().replace(" ", "  ")})]), final]).correct
    assert "no tool" in t.verify([reply(f"The answer is {truth}.")]).reason  # a right guess is not enough
    wrong_key = {"key": key.rsplit(" of ", 1)[0] + " of Nowhere"}
    assert "never called" in t.verify([reply(tool_calls=[call("lookup", wrong_key)]), final]).reason
    assert "never called" in t.verify([reply(tool_calls=[call("calculator", {"expression": "1"})]), final]).reason
    assert "never called" in t.verify([reply(tool_calls=[call("lookup", "{not json")]), final]).reason
    assert "the tool gave" in t.verify([first, reply("The answer is 42.")]).reason
    assert "ended on a tool call" in t.verify([first, first]).reason
    assert "malformed" in t.verify([first, reply(truth, errors=["call 1 (lookup): bad"])]).reason
    assert "cut off" in t.verify([first, reply(truth, complete=False)]).reason
    assert "turns" in t.verify([first] * 3 + [final]).reason
    # a bad call, its error result, then the right one: correct, the bad one counted
    s = t.verify([reply(tool_calls=[call("lookup", wrong_key)]), first, final])
    assert s.correct and s.bad_calls == 1 and s.tool_calls == 2


def test_tool_convert_arguments_compare_by_value():
    t = next(x for x in make_domain("tool").tasks("train", 50) if x.expected_call["tool"] == "convert")
    args = dict(t.expected_call["arguments"])
    _, final = reference_replies(t)
    assert t.verify([reply(tool_calls=[call("convert", {**args, "value": float(args["value"])})]), final]).correct
    assert not t.verify([reply(tool_calls=[call("convert", {**args, "value": args["value"] + 1})]), final]).correct
    assert not t.verify([reply(tool_calls=[call("convert", {**args, "value": True})]), final]).correct


# ---------------------------------------------------------------- XTML round trips

def parse_tail(x: XTML, prompt, full) -> Reply:
    """The tokens the model would have emitted after `prompt` (a token prefix of `full`), parsed."""
    assert full.token_ids[:len(prompt.token_ids)] == prompt.token_ids
    p = x.parser_for(prompt)
    p.feed(full.token_ids[len(prompt.token_ids):])
    p.finish()
    return p.reply


@lru_cache(maxsize=1)
def _sandbox_error() -> str:
    from k3.envs import Sandbox, SandboxError
    try:
        Sandbox().close()
    except SandboxError as e:
        return str(e)
    return ""


def _need_sandbox() -> None:
    if _sandbox_error():
        pytest.skip(f"no sandbox on this host: {_sandbox_error()}")


# the shell domain's episodes run sandboxed (~3 s an effort): one effort in the default run
@pytest.mark.parametrize("name, effort", [
    pytest.param(n, e, marks=pytest.mark.slow) if (n, e) == ("shell", "max") else (n, e)
    for e in ("low", "max") for n in NAMES])
def test_render_parse_round_trip(name, effort):
    if name == "shell":  # its tools run in a sandbox (k3/tasks/shell.py)
        _need_sandbox()
    x = xtml()
    for t in make_domain(name).tasks("heldout", 5):
        history, replies = list(t.messages), []
        for m in t.reference:
            if m["role"] != "assistant":
                continue  # tool results come from continue_with_tool_results below
            prompt = t.render(x, history, effort)
            assert f"thinking_effort={effort}" in x.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
            full = x.render(history + [m], tools=t.tools, reasoning_effort=effort, add_generation_prompt=False)
            r = parse_tail(x, prompt, full)
            assert r.complete and not r.errors and r.content == (m.get("content") or "")
            replies.append(r)
            if needs_another_turn(t, r, len(replies)):
                history = continue_with_tool_results(t, r, history)
        assert len(replies) == (1 if t.tools is None else 2)
        assert t.verify(replies).correct, t.verify(replies).reason
        wrong = x.render(t.messages + [{"role": "assistant", "reasoning_content": "hm", "content": "7777"}],
                         tools=t.tools, reasoning_effort=effort, add_generation_prompt=False)
        assert not t.verify(parse_tail(x, t.render(x, effort=effort), wrong)).correct


def test_round_trip_of_a_cut_off_reply_is_wrong():
    x = xtml()
    t = make_domain("arithmetic").task("heldout", 0)
    prompt = t.render(x)
    full = x.render(t.messages + t.reference, add_generation_prompt=False)
    tail = full.token_ids[len(prompt.token_ids):]
    p = x.parser_for(prompt)
    end = max(i for i, token in enumerate(tail) if token == x.close)  # <|close|>message
    p.feed(tail[:end])  # the answer is there, the reply's end is not
    p.finish()
    assert p.reply.content == t.answer and "cut off" in t.verify(p.reply).reason


# ---------------------------------------------------------------- the tool episode

def test_tool_episode_end_to_end():
    d = make_domain("tool")
    for t in d.heldout(6):
        want = t.expected_call
        wrong = {**want["arguments"], **({"key": "colour of Nowhere"} if want["tool"] == "lookup" else {"to": "parsec"})}
        script = [reply(reasoning="try", tool_calls=[call(want["tool"], wrong)]),
                  reply(reasoning="again", tool_calls=[call(want["tool"], want["arguments"])]),
                  None]  # the last answer is written from the tool result the episode actually returns
        prompt = json.dumps(t.messages)
        messages, replies = list(t.messages), []
        for turn in range(1, t.max_turns + 1):
            r = script[turn - 1] or reply(f"It is {messages[-1]['content']}.")
            replies.append(r)
            if not needs_another_turn(t, r, turn):
                break
            messages = continue_with_tool_results(t, r, messages)
            assert messages[-2]["role"] == "assistant" and messages[-2]["reasoning_content"] == r.reasoning
            assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == r.tool_calls[0]["id"]
        assert messages[-1]["content"] == t.answer and messages[-3]["content"].startswith("error:")
        s = t.verify(replies)
        assert s.correct and s.turns == 3 and s.tool_calls == 2 and s.bad_calls == 1
        t.render(xtml(), messages)  # the episode's history renders (ids match calls)
        assert json.dumps(t.messages) == prompt  # the task's prompt is untouched
    with pytest.raises(ValueError, match="calls no tool"):
        continue_with_tool_results(t, reply("hi"))
    assert not needs_another_turn(t, reply(tool_calls=[call("lookup", {"key": "x"})]), t.max_turns)


# ---------------------------------------------------------------- the long tail

def test_long_tail_knob():
    def lengths(d):  # reasoning characters of the reference trace: what a solving model must think
        return sorted(len(t.reference[0]["reasoning_content"]) for t in d.tasks("train", 800))

    flat, tail = lengths(make_domain("arithmetic")), lengths(make_domain("arithmetic", **LONG_TAIL))
    med, p99 = statistics.median(tail), tail[int(0.99 * len(tail))]
    assert p99 >= 5 * med and statistics.mean(tail) > 1.3 * med  # a heavy right tail
    assert flat[int(0.99 * len(flat))] <= 4 * statistics.median(flat)
    levels = [t.level for t in make_domain("arithmetic", **LONG_TAIL).tasks("train", 800)]
    assert levels.count(1) > levels.count(2) > levels.count(4) > 0 and max(levels) >= 10


def test_reference_at_each_effort_thinks_less_and_answers_the_same():
    for name in ("arithmetic", "strings", "tool"):
        for task in make_domain(name).tasks("train", 24):
            by = {e: task.reference_at(e) for e in ("max", "high", "low")}
            assert by["max"] == task.reference
            think = {e: sum(len(m.get("reasoning_content") or "") for m in r) for e, r in by.items()}
            assert think["low"] == 0 < think["high"] <= think["max"]
            if name != "tool":  # the brief trace is strictly shorter; tool keeps its one sentence
                assert think["high"] < think["max"]
            for e in ("high", "low"):  # the same answer and calls, the task itself untouched
                assert [m.get("content") for m in by[e]] == [m.get("content") for m in task.reference]
                assert [m.get("tool_calls") for m in by[e]] == [m.get("tool_calls") for m in task.reference]
        with pytest.raises(ValueError, match="effort"):
            task.reference_at("medium")
    for t in make_domain("arithmetic").tasks("train", 24):  # arithmetic's brief: each step's result
        results = re.findall(r"= (\d+)\.", t.reference[0]["reasoning_content"])
        assert t.brief == " ".join(f"{r}." for r in results) and results[-1] == t.answer
