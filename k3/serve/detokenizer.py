"""Incremental detokenization and stop strings for one request's stream.

Text comes from `tokenizers.decoders.DecodeStream` (it holds back bytes until they form whole
UTF-8 characters). Stop strings are matched on the decoded text; text that could still be the
start of a stop string is held back, so a stop string never reaches the client (OpenAI semantics).
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending = ""  # decoded but held back (may start a stop string)
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the newly released text (sets `stopped` on a stop string)."""
        if self.stopped:
            return ""
        for token in token_ids:
            chunk = self._stream.step(self.tokenizer, token)
            if chunk:
                self._pending += chunk
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                self.stopped = True
                self._pending = self._pending[:at]
        if self.stopped:
            return self._release(len(self._pending))
        hold = max((k for s in self.stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        return self._release(len(self._pending) - hold)

    def flush(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        return self._release(len(self._pending))

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self.text += out
        return out
