"""A checker for host-free code (k3.ops.host_free): inside `no_host_reads()` every read of a tensor's
values on the host raises, forward and backward alike, so a CPU test can show that code a CUDA
graph would capture never synchronizes.

Caught: `.item()`, `int()`, `float()`, `bool()` (a Python `if` on a tensor), indexing with a tensor
(all `aten._local_scalar_dense`), `.tolist()` (patched: it reads memory without dispatching), and
ops whose output shape depends on values (torch's `dynamic_output_shape` tag: `nonzero`, boolean
masks, `bincount`, `unique`, `repeat_interleave` without `output_size`), and the ops known to read
inside their own C++ kernel (`HIDDEN_READS`: `masked_scatter`'s backward runs a masked select).
Not caught: such reads in ops not listed (the GPU capture tests cover the rest).
`allow_host_reads(fn)` wraps a function whose reads are exempt (a CPU-only path).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_paused = [0]


class HostRead(AssertionError):
    pass


# untagged ops whose kernels read device values on the host
HIDDEN_READS = frozenset({torch.ops.aten.masked_scatter_backward.default})


def _dynamic(func, args, kwargs) -> bool:
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])  # a boolean mask
    return True


class _HostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _paused[0] and (torch.Tag.data_dependent_output in func.tags or func in HIDDEN_READS
                               or _dynamic(func, args, kwargs)):
            raise HostRead(f"host read: {func}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads():
    tolist = torch.Tensor.tolist

    def checked_tolist(self):
        if not _paused[0]:
            raise HostRead("host read: Tensor.tolist")
        return tolist(self)

    torch.Tensor.tolist = checked_tolist
    try:
        with _HostReads():
            yield
    finally:
        torch.Tensor.tolist = tolist


def allow_host_reads(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        _paused[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _paused[0] -= 1
    return run
