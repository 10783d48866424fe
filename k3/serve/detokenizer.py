"""Incremental detokenization and stop strings for one request's stream.

Text comes from `tokenizers.decoders.DecodeStream` (it holds back bytes until they form whole
UTF-8 characters). Stop strings are matched on the decoded text; text that could still be the
start of a stop string is held back, so a stop string never reaches the client (OpenAI semantics).

Matching is bounded: the held-back text is at most the longest stop string minus one character,
so each push scans only the new text plus that tail (stop strings are short: see
k3.serve.sampling.MAX_STOP_CHARS).
"""
from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from k3.text.partial_match import StopStrings


class TextView(Protocol):
    """What a request stream makes of its tokens: `push` the new ids (returns the delta's text),
    `flush` at the end, `stopped` once it found a stop (the stream then ends the request)."""
    stopped: bool

    def push(self, token_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """The request stream's text view (`push` / `flush` / `stopped`, as `RequestStream` uses it):
    the decoded text, stop strings matched on it."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = StopStrings(stop)
        self.text = ""  # everything released so far

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly released text (sets `stopped` on a stop string)."""
        if self.stopped:
            return ""
        decoded = "".join(chunk for token in token_ids if (chunk := self._stream.step(self.tokenizer, token)))
        return self._keep(self._stops.push(decoded))

    def flush(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        return self._keep(self._stops.flush())

    def _keep(self, out: str) -> str:
        self.text += out
        return out
