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

A serving step that continues cached sequences (one document per cache row) also passes static
hints the packer knows on the host, so MLA can attend over a fixed grid (k3/model/mla.py): `chunk`,
no document has more than `chunk` new tokens, and `decode_rows`, the first `decode_rows` documents
have at most one each. They belong in the graph's key; `check_chunk` validates them once per step.
"""
from __future__ import annotations

import contextlib
import itertools
import threading

_state = threading.local()
_DEFAULTS = {"on": False, "segment": None, "chunk": None, "decode_rows": 0}


def active() -> bool:
    """True inside `host_free()` (on this thread)."""
    return getattr(_state, "on", False)


def segment() -> int | None:
    """The `segment` of the innermost `host_free(segment=...)`: no document crosses a multiple of
    it (a row of whole training windows), so attention may run segment by segment."""
    return getattr(_state, "segment", None) if active() else None


def chunk() -> int | None:
    """The `chunk` of the innermost `host_free(chunk=...)`: no document of a packed row has more new
    tokens (None: no promise, so at most the row's length)."""
    return getattr(_state, "chunk", None) if active() else None


def decode_rows() -> int:
    """The `decode_rows` of the innermost `host_free(decode_rows=...)`: the first that many documents
    of a packed row have at most one new token each (0 outside the mode)."""
    return getattr(_state, "decode_rows", 0) if active() else 0


@contextlib.contextmanager
def host_free(segment: int | None = None, *, chunk: int | None = None, decode_rows: int = 0):
    """Select the ops' host-free paths for the code inside (nests; thread-local). The caller's
    promises (None / 0: none): `segment`, documents never cross a multiple of it; `chunk`, no
    document has more than `chunk` tokens; `decode_rows`, the first that many have at most one."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"host_free: chunk must be >= 1 or None, got {chunk}")
    if decode_rows < 0:
        raise ValueError(f"host_free: decode_rows must be >= 0, got {decode_rows}")
    before = {name: getattr(_state, name, default) for name, default in _DEFAULTS.items()}
    _state.on, _state.segment, _state.chunk, _state.decode_rows = True, segment, chunk, decode_rows
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(_state, name, value)


def check_chunk(cu_seqlens, chunk: int | None, decode_rows: int = 0) -> None:
    """Check a step's hints against its packed boundaries on the host (a CPU tensor or a list of
    ints), once per step outside the graph: a broken promise would attend wrong keys silently."""
    bounds = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    counts = [b - a for a, b in itertools.pairwise(bounds)]
    if decode_rows > len(counts):
        raise ValueError(f"host_free: decode_rows={decode_rows} but the row has {len(counts)} documents")
    if any(c < 0 for c in counts):
        raise ValueError(f"host_free: cu_seqlens must be non-decreasing, got {bounds}")
    wide = [n for n in range(decode_rows) if counts[n] > 1]
    if wide:
        raise ValueError(f"host_free: decode row {wide[0]} has {counts[wide[0]]} new tokens, at most 1 allowed")
    if chunk is not None and counts and max(counts) > chunk:
        n = counts.index(max(counts))
        raise ValueError(f"host_free: document {n} has {counts[n]} new tokens, more than chunk={chunk}")
