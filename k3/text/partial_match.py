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
