"""Host-free mode: every op takes a path that never reads a device tensor back to the host, so a
whole step (forward, backward, optimizer) can be captured once as a CUDA graph and replayed
(k3/train/graph_step.py).

Inside `host_free()`, a packed row's `cu_seqlens` has a fixed number of entries: the real
documents' boundaries, then zero-length documents (entries equal to T) up to the step's fixed
count, so the same graph serves every step whatever its documents. Ops must then neither call
`.tolist()` / `.item()` / `int(tensor)` on it nor size an output by its values: the metadata they
need (document ids, positions in a document) is built on the device with fixed shapes, and
validation that reads values happens once per step, outside the graph, where the batch is packed.
Outside the mode nothing changes.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def active() -> bool:
    """True inside `host_free()` (on this thread)."""
    return getattr(_state, "on", False)


def segment() -> int | None:
    """The `segment` of the innermost `host_free(segment=...)`: no document crosses a multiple of
    it (a row of whole training windows), so attention may run segment by segment."""
    return getattr(_state, "segment", None) if active() else None


@contextlib.contextmanager
def host_free(segment: int | None = None):
    """Select the ops' host-free paths for the code inside (nests; thread-local). `segment`: the
    caller's promise that documents never cross a multiple of it (None: no promise)."""
    before = active(), getattr(_state, "segment", None)
    _state.on, _state.segment = True, segment
    try:
        yield
    finally:
        _state.on, _state.segment = before
