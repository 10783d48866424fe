"""Session keys: explicit keys first, else the engine's prefix-cache key of the session's opening,
the same on every turn of a chat."""
from __future__ import annotations

import pytest

from k3.route.affinity import PromptKeys, SessionKeyError, explicit_key, prefix_key
from k3.serve.block_hash import ROOT_KEY, chain_hash, extend_block_hashes
from k3.text.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def keys():
    return PromptKeys(train_tokenizer(["hello there, how are you today?"] * 4, 300), hash_block_size=8, blocks=2)


def test_explicit_keys_header_first_then_user():
    assert explicit_key({}, {}) is None
    assert explicit_key({"x-session-id": "a"}, {"user": "b"}) == explicit_key({"x-session-id": "a"}, {})
    assert explicit_key({}, {"user": "a"}) != explicit_key({"x-session-id": "a"}, {})
    for bad in (5, "", "x" * 257, "tab\there"):
        with pytest.raises(SessionKeyError):
            explicit_key({}, {"user": bad})


def test_prefix_keys_are_the_engine_s_block_hashes():
    tokens = list(range(30))
    assert prefix_key(tokens, 8, 2) == extend_block_hashes([], tokens[:16], 8)[-1]
    assert prefix_key(tokens[:5], 8, 2) == chain_hash(ROOT_KEY, tokens[:5])
    hashes = extend_block_hashes([], tokens, 8)
    assert prefix_key(tokens, 8, None) == chain_hash(hashes[-1], tokens[24:])


def test_a_chat_keeps_its_key_turn_after_turn_and_sessions_differ(keys):
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    later = first + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you?"}]
    (k1, n1), (k2, n2) = keys.analyse({"messages": first}, chat=True), keys.analyse({"messages": later}, chat=True)
    assert k1 == k2 and n2 > n1
    other = [first[0], {"role": "user", "content": "hello you"}]
    assert keys.analyse({"messages": other}, chat=True)[0] != k1  # a shared system prompt alone does not pin


def test_anything_gets_a_key(keys):
    for body, chat in (({"messages": "nope"}, True), ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                                       True), ({"prompt": [1, 2, 3]}, False), ({"prompt": None}, False)):
        key, tokens = keys.analyse(body, chat=chat)
        assert isinstance(key, bytes) and tokens >= 0
    assert PromptKeys(None, 8).analyse({"prompt": "abc"}, chat=False)[1] == 3  # no tokenizer: bytes
