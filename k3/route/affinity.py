"""A request's session key: what the hash ring places (K3 report §7.4).

In order: the `X-Session-ID` header, else the body's `user` field, else the prompt's own prefix: the
engine's prefix-cache key (k3.serve.block_hash.chain_hash, DESIGN §11) of the session's opening.
For a chat the opening is the messages up to the first user message, rendered as the replica renders
them, keyed whole: it is the same on every later turn of the session, so each turn follows the first
to the replica holding its prefix, and sessions that share only a system prompt still spread. For a
completion (no turns to go by) it is the prompt's first `blocks` hash blocks, its full blocks when it
is shorter, so a client whose prompts grow turn by turn should send `user` (or the header).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer

from k3.serve.block_hash import ROOT_KEY, chain_hash, extend_block_hashes
from k3.text.tokenizer import encode_text
from k3.text.xtml import XTML

SESSION_HEADER = "x-session-id"
MAX_SESSION_KEY_CHARS = 256
DEFAULT_AFFINITY_BLOCKS = 4


class SessionKeyError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _checked(value, param: str) -> str:
    if not isinstance(value, str):
        raise SessionKeyError(f"{param}: a session key must be a string, got {type(value).__name__}", param)
    if not 1 <= len(value) <= MAX_SESSION_KEY_CHARS:
        raise SessionKeyError(f"{param}: a session key has 1 to {MAX_SESSION_KEY_CHARS} characters, got {len(value)}",
                              param)
    if not value.isprintable():
        raise SessionKeyError(f"{param}: a session key must be printable text (no control characters)", param)
    return value


def explicit_key(headers: Mapping[str, str], body: dict) -> bytes | None:
    """The key the client named (header first, then `user`), hashed; None when it named none.
    SessionKeyError (a 400) for a header or `user` that is not a short printable string."""
    if SESSION_HEADER in headers:
        return _digest(b"header", _checked(headers[SESSION_HEADER], "X-Session-ID"))
    if body.get("user") is not None:
        return _digest(b"user", _checked(body["user"], "user"))
    return None


def _digest(kind: bytes, text: str) -> bytes:
    return hashlib.blake2b(kind + b"\0" + text.encode(), digest_size=16).digest()


def prefix_key(tokens: Sequence[int], hash_block_size: int, blocks: int | None) -> bytes:
    """The engine's prefix-cache key of `tokens` cut to its first `blocks` full hash blocks (the whole
    of a prompt shorter than one block); blocks=None: of all of `tokens`, the partial last block too."""
    if blocks is None:
        full = len(tokens) // hash_block_size
        hashes = extend_block_hashes([], tokens, hash_block_size)
        rest = tokens[full * hash_block_size:]
        return hashes[-1] if hashes and not rest else chain_hash(hashes[-1] if hashes else ROOT_KEY, rest)
    full = min(len(tokens) // hash_block_size, blocks)
    if full == 0:
        return chain_hash(ROOT_KEY, tokens)
    return extend_block_hashes([], tokens[:full * hash_block_size], hash_block_size)[-1]


def opening(messages: list) -> list:
    """The messages up to and including the first user message (all of them if none is)."""
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            return messages[:i + 1]
    return messages


class PromptKeys:
    """Session keys from prompts, with the replicas' tokenizer when the router has one (else the
    prompt's UTF-8 bytes stand in for its tokens: the same sessions, no longer the engine's keys)."""

    def __init__(self, tokenizer: Tokenizer | None, hash_block_size: int, blocks: int = DEFAULT_AFFINITY_BLOCKS):
        if hash_block_size < 1 or blocks < 1:
            raise ValueError(f"hash block size and affinity blocks must be >= 1, got {hash_block_size}, {blocks}")
        self.tokenizer, self.hash_block_size, self.blocks = tokenizer, hash_block_size, blocks
        try:
            self.chat = None if tokenizer is None else XTML(tokenizer)
        except ValueError:  # a tokenizer without K3's chat markers: chats are keyed on their bytes
            self.chat = None

    def analyse(self, body: dict, *, chat: bool) -> tuple[bytes, int]:
        """The prompt's key and its length in tokens (what admission charges); never raises: a body
        the replica will refuse still gets a place."""
        if not chat:
            tokens = self._prompt_tokens(body.get("prompt"))
            return prefix_key(tokens, self.hash_block_size, self.blocks), len(tokens)
        messages = body.get("messages")
        first = opening(messages) if isinstance(messages, list) else messages
        head = self._chat_tokens(first, body)
        whole = head if first is messages else self._chat_tokens(messages, body)
        return prefix_key(head, self.hash_block_size, None), len(whole)

    def _chat_tokens(self, messages, body: dict) -> list[int]:
        # a chat the renderer refuses (the replica will say why) is placed by its bytes
        with contextlib.suppress(Exception):
            if self.chat is not None:
                return self.chat.render(messages, tools=body.get("tools") or None, add_generation_prompt=False).token_ids
        return list(json.dumps(messages, sort_keys=True).encode())

    def _prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            try:
                return encode_text(self.tokenizer, prompt)
            except ValueError:  # not valid Unicode: the replica refuses it
                pass
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        return list(text.encode(errors="surrogatepass"))
