"""Copy-on-write file layers and snapshots, the way container images stack them.

A sandbox's root is an overlayfs (mounted by bwrap inside the sandbox's own mount namespace, so no
mount ever exists on the host) of a stack of read-only layers under one writable upper directory:

  base     a small tree built once per store: /home/agent, /tmp, a minimal /etc, the mount points and
           merged-/usr symlinks (so bwrap never writes into the upper), owned by the sandbox uid
  layers/  frozen former upper directories, immutable once frozen, shared by every sandbox whose
           stack holds them (forks, restores)
  sbx/     each live sandbox's upper + overlay work directory

snapshot = rename the upper into layers/ (O(1): only the changes since the last snapshot are in it,
which is what makes snapshots incremental) and start an empty upper; fork and restore = a new empty
upper on an existing stack (O(1), no copy). Stacks deeper than MAX_DEPTH are squashed into one layer
by copying the merged view (bwrap's kernel limit is the lowerdir mount option, one page long).

Lifetimes: a snapshot id lives until the sandbox that took it closes (or drop_snapshot); a layer
lives while a snapshot or a live sandbox's stack holds it; the store's directory is removed when its
last holder releases it, at interpreter exit, or, after a SIGKILL, by the next store made on the host.
"""
from __future__ import annotations

import atexit
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

from k3.envs.errors import SandboxError
from k3.envs.host import CGROUP_PREFIX, drop_to, host_ro_args, merged_usr_args, probe
from k3.envs.limits import sweep_stale_cgroups

MAX_DEPTH = 32  # layers above base before a squash; 32 paths of ~50 bytes fit lowerdir's page
STORE_PREFIX = CGROUP_PREFIX
SANDBOX_HOME = "/home/agent"
_BASE_DIRS = ("home", "home/agent", "tmp", "etc", "usr", "proc", "dev", "root")
_ETC_FILES = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nagent:x:{uid}:{gid}:agent:/home/agent:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nagent:x:{gid}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}

_live_stores: weakref.WeakSet[LayerStore] = weakref.WeakSet()


def tree_bytes(root: Path) -> int:
    """Bytes allocated under `root` (st_blocks, so sparse files count what they really use)."""
    total, stack = 0, [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    st = e.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except FileNotFoundError:
            continue
    return total


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(parent: Path) -> list[Path]:
    """Remove store directories left by processes that died without cleaning up (SIGKILL); their
    cgroups are swept beside them (k3/envs/limits.py)."""
    removed = []
    for d in parent.glob(f"{STORE_PREFIX}*"):
        parts = d.name[len(STORE_PREFIX):].split("-")
        if d.is_dir() and parts[0].isdigit() and not pid_alive(int(parts[0])):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class LayerStore:
    """The layers, snapshots and sandbox directories of one family of sandboxes sharing a base."""

    def __init__(self, uid: int, gid: int, root_dir: str | None = None):
        self.uid, self.gid = uid, gid
        parent = Path(root_dir or tempfile.gettempdir())
        sweep_stale(parent)
        sweep_stale_cgroups(probe().cgroup_dirs, STORE_PREFIX, pid_alive)
        self.root = parent / f"{STORE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.root.mkdir(mode=0o711)  # the sandbox uid must traverse it; nobody may list it
        self._lock = threading.RLock()
        self._holders = 0
        self._snapshots: dict[str, tuple[Path, ...]] = {}
        self._live: dict[str, tuple[Path, ...]] = {}  # sandbox name -> its current stack
        self._layer_bytes: dict[Path, int] = {}
        self.closed = False
        try:
            for d in ("layers", "sbx", "trash"):
                self._mkdir(self.root / d)
            self.base = self._build_base()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        _live_stores.add(self)

    def _mkdir(self, path: Path, mode: int = 0o755) -> Path:
        path.mkdir(mode=mode)
        if os.geteuid() == 0:
            os.chown(path, self.uid, self.gid)
        return path

    def _build_base(self) -> Path:
        base = self._mkdir(self.root / "base")
        for d in _BASE_DIRS:
            self._mkdir(base / d, 0o1777 if d == "tmp" else 0o700 if d == "root" else 0o755)
        os.chmod(base / "tmp", 0o1777)  # mkdir's mode is masked by umask
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/", name)
            if host.is_symlink():
                os.symlink(os.readlink(host), base / name)
                if os.geteuid() == 0:
                    os.lchown(base / name, self.uid, self.gid)
            elif host.is_dir():
                self._mkdir(base / name)
        for name in ("alternatives",):
            if Path("/etc", name).is_dir():
                self._mkdir(base / "etc" / name)
        for name, text in _ETC_FILES.items():
            (base / "etc" / name).write_text(text.format(uid=self.uid, gid=self.gid))
        if Path("/etc/ld.so.cache").exists():
            (base / "etc" / "ld.so.cache").touch()  # the bind-mount point
        return base

    # -- holders: the store lives while a sandbox or pool holds it

    def hold(self) -> None:
        with self._lock:
            self._check_open()
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders <= 0:
                self.destroy()

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"layer store {self.root} is closed")

    # -- sandbox directories

    def new_sandbox(self, name: str, stack: tuple[Path, ...] | None = None) -> tuple[Path, Path, tuple[Path, ...]]:
        """(upper, work, stack) of a new sandbox on `stack` (default: the base alone)."""
        with self._lock:
            self._check_open()
            home = self._mkdir(self.root / "sbx" / name, 0o700)
            stack = stack or (self.base,)
            upper, work = self._fresh_upper(home / "upper", stack), self._mkdir(home / "work")
            self._live[name] = stack
            return upper, work, stack

    def _fresh_upper(self, upper: Path, stack: tuple[Path, ...]) -> Path:
        """An empty upper whose times are the top layer's: overlayfs shows the upper's own root
        directory as "/", so a new one must not change the tree's root mtime."""
        self._mkdir(upper)
        top = stack[-1].stat()
        os.utime(upper, ns=(top.st_atime_ns, top.st_mtime_ns))
        return upper

    def reset_upper(self, name: str, upper: Path, stack: tuple[Path, ...]) -> None:
        """Discard the upper (the changes since the last snapshot) and sit on `stack` instead."""
        with self._lock:
            self._check_open()
            self._discard(upper)
            self._fresh_upper(upper, stack)
            self._live[name] = stack
            self._gc()

    def drop_sandbox(self, name: str) -> None:
        with self._lock:
            self._live.pop(name, None)
            if (self.root / "sbx" / name).exists():
                self._discard(self.root / "sbx" / name)
            self._gc()

    # -- snapshots

    def freeze(self, name: str, upper: Path, stack: tuple[Path, ...]) -> tuple[Path, ...]:
        """The upper becomes the stack's top layer; an empty upper leaves the stack as it is."""
        with self._lock:
            self._check_open()
            if not any(os.scandir(upper)):
                return stack
            layer = self.root / "layers" / secrets.token_hex(6)
            os.rename(upper, layer)
            self._layer_bytes[layer] = tree_bytes(layer)
            stack = stack + (layer,)
            self._fresh_upper(upper, stack)
            if len(stack) > MAX_DEPTH:
                stack = self._squash(stack)
            self._live[name] = stack
            self._gc()
            return stack

    def register(self, stack: tuple[Path, ...]) -> str:
        with self._lock:
            self._check_open()
            snap = secrets.token_hex(8)
            self._snapshots[snap] = stack
            return snap

    def stack_of(self, snap: str) -> tuple[Path, ...]:
        with self._lock:
            self._check_open()
            if snap not in self._snapshots:
                raise SandboxError(f"unknown snapshot {snap!r} (dropped, or taken in another store)")
            return self._snapshots[snap]

    def drop_snapshot(self, snap: str) -> None:
        with self._lock:
            if self._snapshots.pop(snap, None) is not None:
                self._gc()

    def stack_bytes(self, stack: tuple[Path, ...]) -> int:
        """The frozen part of a sandbox's data (its layers above the base image)."""
        return sum(self._layer_bytes.get(layer, 0) for layer in stack)

    def _squash(self, stack: tuple[Path, ...]) -> tuple[Path, ...]:
        """One layer holding the merged view of `stack` (whiteouts resolved by the kernel's own
        overlay), copied by `cp -a` as the sandbox uid inside a bwrap that sees nothing else."""
        layer = self._mkdir(self.root / "layers" / secrets.token_hex(6))
        argv = [probe().bwrap, "--unshare-all", "--unshare-user", "--die-with-parent"]
        for lower in stack:
            argv += ["--overlay-src", str(lower)]
        argv += ["--ro-overlay", "/src", "--bind", str(layer), "/dst", *host_ro_args(), *merged_usr_args(),
                 "--", "/usr/bin/cp", "-a", "/src/.", "/dst/"]
        done = subprocess.run(argv, check=False, capture_output=True, text=True,
                              preexec_fn=drop_to(self.uid, self.gid) if os.geteuid() == 0 else None)
        if done.returncode != 0:
            shutil.rmtree(layer, ignore_errors=True)
            raise SandboxError(f"squashing {len(stack)} layers failed: {done.stderr.strip()[-200:]}")
        self._layer_bytes[layer] = tree_bytes(layer)
        return (layer,)

    def _gc(self) -> None:
        """Remove layers no snapshot and no live sandbox stands on."""
        used = {layer for stacks in (self._snapshots.values(), self._live.values()) for s in stacks for layer in s}
        for layer in list(self._layer_bytes):
            if layer not in used:
                self._discard(layer)
                del self._layer_bytes[layer]

    def _discard(self, path: Path) -> None:
        """Move `path` out of the way at once (a rename) and delete it on a background thread:
        unlinking is slow on some filesystems (ext4 mounted with `discard`: ~3 ms a file)."""
        trash = self.root / "trash" / secrets.token_hex(6)
        os.rename(path, trash)
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()

    def destroy(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            shutil.rmtree(self.root, ignore_errors=True)
            _live_stores.discard(self)


@atexit.register
def _destroy_all() -> None:
    """Interpreter exit: stores never released still leave nothing behind (k3/envs/sandbox.py's own
    hook, registered later so run earlier, has closed the sandboxes and their cgroups by then)."""
    for store in list(_live_stores):
        store.destroy()
