"""Effort control (k3/rl/effort.py): the length T(y) counted on real XTML token streams, cold-start
budgets and their fallbacks, the shaped reward, the three levels and their XTML effort message."""
from __future__ import annotations

import pytest

from k3.rl.effort import (
    DEFAULT_BUDGET,
    EFFORTS,
    MIN_BUDGET,
    TAU_MAX,
    Budget,
    cold_start_budgets,
    effort,
    length_of,
    load_budgets,
    reference_length,
    sampled_figures,
    save_budgets,
    shaped_reward,
    think_tokens,
    within_budget,
)
from k3.tasks.domains import make_domain
from k3.text.tokenizer import encode_texts
from tests.tasks.test_domains import xtml


def generated(x, task, assistant: dict, history=None, effort_name="max") -> list[int]:
    """The ids a model emits for `assistant` after the task's generation prompt."""
    history = task.messages if history is None else history
    prompt = x.render(history, tools=task.tools, reasoning_effort=effort_name)
    full = x.render(history + [assistant], tools=task.tools, reasoning_effort=effort_name, add_generation_prompt=False)
    assert full.token_ids[:len(prompt.token_ids)] == prompt.token_ids
    return full.token_ids[len(prompt.token_ids):]


def test_think_tokens_count_the_think_channel():
    x = xtml()
    t = make_domain("arithmetic").task("train", 1)
    ref = t.reference[0]
    ids = generated(x, t, ref)
    n = len(encode_texts(x.tokenizer, [ref["reasoning_content"]])[0])
    assert think_tokens(ids, x) == n == length_of(ids, "arithmetic", x) == length_of([ids], "arithmetic", x)
    assert think_tokens(generated(x, t, {"role": "assistant", "content": "28"}), x) == 0
    assert think_tokens(ids, x, opened="response") == 0  # thinking off: nothing is thinking
    # cut short inside the channel: all of it is thinking; a stop token ends it
    assert think_tokens(ids[:n - 2], x) == n - 2 and think_tokens(ids[:3] + [x.end_of_msg] + ids[3:], x) == 3
    # a stray element inside the channel is thinking too (it cannot hide tokens from the budget)
    stray = [x.open, *x.tokenizer.encode("foo").ids, x.sep, *ids[:2], x.close, *x.tokenizer.encode("foo").ids, x.sep]
    assert think_tokens(stray + ids, x) == len(stray) + n
    # an opening response closes the channel, as the parser reads it
    skip = [*ids[:2], x.open, *x.tokenizer.encode("response").ids, x.sep, *x.tokenizer.encode("28").ids]
    assert think_tokens(skip, x) == 2


def test_tool_length_counts_every_generated_token():
    x = xtml()
    t = make_domain("tool").task("train", 1)
    first, result, final = t.reference
    turn1 = generated(x, t, first)
    turn2 = generated(x, t, final, history=t.messages + [first, result])
    assert length_of([turn1, turn2], "tool", x) == len(turn1) + len(turn2)
    assert think_tokens(turn1, x) < len(turn1)  # the call's arguments count for tools, not for reasoning
    with pytest.raises(ValueError, match="unknown domain"):
        length_of(turn1, "chess", x)
    assert length_of([], "strings", x) == 0


def test_cold_start_budgets():
    samples = {
        "a": [(True, 10), (True, 30), (False, 500), (True, 20), (True, 400)],  # median of correct: 25
        "b": [(True, 40), (False, 3)],
        "c": [(False, 90), (False, 70)],  # none correct: the domain's median b0
        "d": [(True, 2)],  # floored
    }
    b = cold_start_budgets(samples, "arithmetic")
    assert b["a"] == Budget("a", "arithmetic", 25.0, "correct", 5, 4)
    assert b["b"].b0 == 40.0 and b["d"].b0 == MIN_BUDGET
    assert b["c"].source == "domain" and b["c"].b0 == 25.0 and b["c"].n_correct == 0  # median of 25, 40, 8
    none = cold_start_budgets({"x": [(False, 5)], "y": []}, "tool")
    assert {v.source for v in none.values()} == {"default"} and none["x"].b0 == DEFAULT_BUDGET["tool"]
    assert cold_start_budgets({"x": [(False, 5)]}, "strings", default=17)["x"].b0 == 17.0
    # an unsolved prompt takes its own reference solution's length when given, floored; a solved one ignores it
    ref = cold_start_budgets(samples, "arithmetic", reference={"a": 99, "c": 60, "d": 1})
    assert ref["c"] == Budget("c", "arithmetic", 60.0, "reference", 2, 0)
    assert ref["a"].b0 == 25.0 and ref["d"].b0 == MIN_BUDGET and ref["d"].source == "correct"
    assert cold_start_budgets({"x": [(False, 5)]}, "strings", reference={"x": 3})["x"].b0 == MIN_BUDGET
    with pytest.raises(ValueError, match="integer"):
        cold_start_budgets({"a": [(True, -1)]}, "strings")
    with pytest.raises(ValueError, match="default"):
        cold_start_budgets({"a": [(True, 1)]}, "strings", default=0)


def test_reference_length():
    x = xtml()
    for name in ("arithmetic", "strings", "tool"):
        t = make_domain(name).task("heldout", 2)
        n = reference_length(t, x)
        if name == "tool":  # every generated token of both turns
            first, result, final = t.reference
            assert n == len(generated(x, t, first)) + len(generated(x, t, final, t.messages + [first, result]))
        else:  # the think tokens of the trace
            assert n == len(encode_texts(x.tokenizer, [t.reference[0]["reasoning_content"]])[0])


def test_shaped_reward():
    assert shaped_reward(True, 50, 25.0, 2.0) == 1.0  # at the budget: kept
    assert shaped_reward(True, 51, 25.0, 2.0) == -1.0  # beyond it: -1 even when right
    assert shaped_reward(False, 10, 25.0, 2.0) == 0.0 and shaped_reward(False, 60, 25.0, 2.0) == -1.0
    assert shaped_reward(0.5, 10, 25.0, 1.0) == 0.5
    # the same trajectory across the levels: inside max's budget, over high's and low's
    assert [shaped_reward(True, 40, 25.0, effort(e).tau) for e in ("max", "high", "low")] == [1.0, -1.0, -1.0]
    assert within_budget(12, 25.0, 0.5) and not within_budget(13, 25.0, 0.5)
    for bad in [{"length": -1}, {"length": 1.5}, {"b0": 0.0}, {"tau": float("nan")}, {"tau": -1.0}]:
        with pytest.raises(ValueError, match="must be"):
            shaped_reward(**{"correct": True, "length": 3, "b0": 10.0, "tau": 1.0, **bad})
    with pytest.raises(ValueError, match="correctness"):
        shaped_reward(2.0, 3, 10.0, 1.0)


def test_effort_levels_and_their_message():
    assert EFFORTS["max"].tau == TAU_MAX > EFFORTS["high"].tau > EFFORTS["low"].tau > 0
    assert EFFORTS["high"].tau == TAU_MAX / 2 and EFFORTS["low"].tau == TAU_MAX / 4
    assert [EFFORTS[e].parent for e in ("max", "high", "low")] == [None, "max", "high"]  # max first, then lower
    assert effort("low").budget(30.0) == 15.0
    with pytest.raises(ValueError, match="effort must be"):
        effort("medium")
    x = xtml()
    t = make_domain("strings").task("train", 0)
    for name, e in EFFORTS.items():
        text = x.tokenizer.decode(x.render(t.messages, **e.xtml_kwargs()).token_ids, skip_special_tokens=False)
        assert f"`thinking_effort={name}`" in text


def test_budgets_round_trip(tmp_path):
    b = cold_start_budgets({"a": [(True, 12)], "b": [(False, 1)]}, "strings")
    path = save_budgets(tmp_path / "budgets.json", b.values())
    assert load_budgets(path) == b
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a budgets file"):
        load_budgets(tmp_path / "bad.json")


def test_sampled_figures_read_pass_at_k_from_the_budget_episodes():
    budgets = [Budget("a", "strings", 8.0, "correct", 4, 1), Budget("b", "strings", 8.0, "correct", 4, 3),
               Budget("c", "strings", 8.0, "reference", 4, 0), Budget("d", "strings", 8.0, "correct", 4, 4)]
    f = sampled_figures(budgets)
    assert f == {"prompts": 4, "k": 4, "pass_at_k": 0.75, "accuracy": 0.5}
    assert sampled_figures([Budget("e", "strings", 8.0, "default", 0, 0)]) is None  # given, not sampled
