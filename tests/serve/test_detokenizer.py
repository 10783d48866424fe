"""Stop strings on the incremental text: what is released equals the whole text cut at the first
stop string (OpenAI semantics), whatever the token chunking, and the held-back tail is found by a
bounded scan (the longest suffix that starts a stop string) instead of one slice per prefix."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.serve.detokenizer import IncrementalDetokenizer
from k3.text.partial_match import held_back
from k3.text.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["abba abab baab aabb ab ba\nab"] * 4, 300)


def naive_held_back(text: str, stop: str) -> int:
    return max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", max_size=12), stop=st.text("ab", min_size=1, max_size=8))
def test_held_back_is_the_longest_suffix_that_starts_the_stop(text, stop):
    assert held_back(text, stop) == naive_held_back(text, stop)


texts = st.text("ab \n", min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=texts, stops=st.lists(st.text("ab \n", min_size=1, max_size=5), max_size=4), data=st.data())
def test_released_text_is_the_text_cut_at_the_first_stop(tokenizer, text, stops, data):
    """The text seen after each push is cut at its first stop string, if any: what was released, and
    nothing more, is that cut (a stop completed by a later push cannot pull back earlier text)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stops)
    out, at, expected = "", 0, text
    while at < len(ids) and not detok.stopped:
        n = data.draw(st.integers(1, 4))
        out += detok.push(ids[at:at + n])
        at += n
        seen = tokenizer.decode(ids[:at])
        cut = min((i for s in stops if (i := seen.find(s)) >= 0), default=None)
        if cut is not None:
            expected = seen[:cut]
            break
    if not detok.stopped:
        out += detok.flush()
    assert out == expected and detok.stopped == any(s in text for s in stops)


def test_a_long_stop_string_costs_its_length_not_its_square(tokenizer):
    """The held-back tail stays under the stop's length, so each push scans a bounded text."""
    stop = "a" * 200 + "b"
    detok = IncrementalDetokenizer(tokenizer, [stop])
    a = tokenizer.encode("a", add_special_tokens=False).ids
    released = "".join(detok.push(a) for _ in range(1000))
    assert len(detok._stops._pending) == len(stop) - 1 and released == "a" * (1000 - len(stop) + 1)
    assert detok.push(tokenizer.encode("b", add_special_tokens=False).ids) == "" and detok.stopped
