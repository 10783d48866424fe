"""Incremental detokenization and stop strings for one request's stream.

Text comes from `tokenizers.decoders.DecodeStream` (it holds back bytes until they form whole
UTF-8 characters). Stop strings are matched on the decoded text; text that could still be the
start of a stop string is held back, so a stop string never reaches the client (OpenAI semantics).

Matching is bounded: the held-back text is at most the longest stop string minus one character,
so each push scans only the new text plus that tail (stop strings are short: see
k3.serve.sampling.MAX_STOP_CHARS).
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from k3.text.partial_match import held_back


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
        # _pending is the held-back tail plus the new text: a stop string can only end in the new text
        first = min((at for s in self.stop if (at := self._pending.find(s)) >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self._pending = self._pending[:first]
            return self._release(len(self._pending))
        hold = max((held_back(self._pending, s) for s in self.stop), default=0)
        return self._release(len(self._pending) - hold)

    def flush(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        return self._release(len(self._pending))

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self.text += out
        return out
