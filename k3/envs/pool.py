"""A pool of warm sandboxes: made up front (store, base image, directories and cgroups ready), handed
out by acquire(), and reclaimed by their close(): the writable layer and snapshots are discarded and
the sandbox, back on the bare base image, waits for the next episode. A sandbox out of the pool is
paused while its episode waits for the model (k3/tasks/shell.py): it then holds no process and no
cgroup, so a pool's memory cost is its running sandboxes only."""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import TYPE_CHECKING

from k3.envs.errors import SandboxError
from k3.envs.layers import LayerStore
from k3.envs.limits import Limits
from k3.envs.sandbox import DEFAULT_UID, Sandbox

if TYPE_CHECKING:
    from typing_extensions import Self


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class _PooledSandbox(Sandbox):
    """A Sandbox whose close() hands it back to its pool rather than removing it."""

    pool: SandboxPool | None = None

    def close(self) -> None:
        pool = self.pool
        if pool is None or self.closed:
            super().close()
        else:
            pool._reclaim(self)

    def _really_close(self) -> None:
        self.pool = None
        super().close()


class SandboxPool:
    """`size` warm sandboxes sharing one layer store (so one base image) and one set of `limits`."""

    def __init__(self, size: int = 4, limits: Limits | None = None, *, uid: int = DEFAULT_UID,
                 root_dir: str | None = None):
        if size < 1:
            raise SandboxError(f"pool size must be at least 1, got {size}")
        self.size, self.limits, self.uid = size, limits or Limits(), uid
        self._lock = threading.Lock()
        self._closed = False
        self.store = LayerStore(uid, uid, root_dir)
        self.store.hold()  # the pool's own hold: the store outlives any one sandbox
        self._idle: list[_PooledSandbox] = []
        try:
            self._idle = [self._make() for _ in range(size)]
        except BaseException:
            self.close()
            raise
        _live_pools.add(self)

    def _make(self) -> _PooledSandbox:
        sandbox = _PooledSandbox(self.limits, uid=self.uid, store=self.store)
        sandbox.pool = self
        return sandbox

    @property
    def idle(self) -> int:
        return len(self._idle)

    def acquire(self) -> Sandbox:
        """A warm sandbox on the bare base image (a new one if all are out)."""
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            if self._idle:
                return self._idle.pop()
        return self._make()

    def _reclaim(self, sandbox: _PooledSandbox) -> None:
        with self._lock:
            keep = not self._closed and len(self._idle) < self.size
        if not keep:
            sandbox._really_close()
            return
        try:
            for snap in list(sandbox._snaps):
                sandbox.drop_snapshot(snap)
            sandbox.resume()
            sandbox.store.reset_upper(sandbox.name, sandbox.upper, (sandbox.store.base,))
            sandbox.stack = (sandbox.store.base,)
        except BaseException:
            sandbox._really_close()
            raise
        with self._lock:
            if self._closed:
                sandbox._really_close()
            else:
                self._idle.append(sandbox)

    def close(self) -> None:
        """Close the idle sandboxes; ones still out are closed for good when they are closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
        _live_pools.discard(self)
        for sandbox in idle:
            sandbox._really_close()
        self.store.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_pools() -> None:
    """Interpreter exit: close the pools first (registered after k3/envs/sandbox.py's hook, so run
    before it), so its close_all really closes the sandboxes still out instead of reclaiming them."""
    for pool in list(_live_pools):
        pool.close()
