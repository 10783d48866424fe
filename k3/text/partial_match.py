"""Holding back streamed text that may be the start of a marker (a stop string, a chat tag): the
part of a text's end that a marker could still continue."""
from __future__ import annotations


def held_back(text: str, stop: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `stop`."""
    tail = text[len(text) - min(len(text), len(stop) - 1):]
    at = tail.find(stop[0]) if stop else -1
    while at >= 0:  # the earliest start that matches gives the longest suffix
        if stop.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(stop[0], at + 1)
    return 0


class StopStrings:
    """Stop strings over a stream of text: `push` returns what may be released now, holding back
    a tail that could still start a stop string; `stopped` once one is found (the text is cut
    before it, so a stop string never reaches the client: OpenAI semantics). Each push scans only
    the new text plus the held tail."""

    def __init__(self, stop: list[str] | None = None):
        self.stop = [s for s in stop or () if s]
        self._pending = ""  # received but held back
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self._pending += text
        first = min((at for s in self.stop if (at := self._pending.find(s)) >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            return self._release(first, drop_rest=True)
        hold = max((held_back(self._pending, s) for s in self.stop), default=0)
        return self._release(len(self._pending) - hold)

    def flush(self) -> str:
        """The text ended without a stop string: release what was held back."""
        return self._release(len(self._pending))

    def _release(self, n: int, drop_rest: bool = False) -> str:
        out, self._pending = self._pending[:n], "" if drop_rest else self._pending[n:]
        return out
