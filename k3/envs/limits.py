"""A sandbox's resource limits and how each is enforced.

What holds for the sandbox as a whole (every process of one exec together), with writable cgroup v1
controllers (root on a v1 or hybrid host; probed in k3/envs/host.py; a v2 host gets the same budgets
from the v2 files, k3/envs/cgroup_v2.py):
  processes  pids.max of a pids group made for each exec; a fork past it fails (EAGAIN) and the exec
             is then killed, reason "pids"
  memory     memory.limit_in_bytes (+ memsw when swap is accounted); the kernel's OOM killer acts
             inside the group, reason "memory" (memory.oom_control's oom_kill count rose)
  CPU time   cpuacct.usage polled by the exec loop (every POLL_S), reason "cpu_time"; RLIMIT_CPU is the
             per-process backstop the kernel enforces even if the poller lags
  disk       the writable layer's allocated blocks, polled every DISK_POLL_S, reason "disk"; RLIMIT_FSIZE
             caps every single file at once (the write fails with SIGXFSZ, reason "file_size"), so the
             overshoot is bounded by one poll interval of writes of at most file_size_bytes each
  CPU share  cpu.cfs_quota_us (v2: cpu.max) of `cpus` cores, where the cpu controller is there: a busy
             sandbox is throttled, not killed, so it cannot starve the host or the other sandboxes
Without cgroups (not root, or a v2 host whose controllers cannot be delegated, see cgroup_v2.py) the
fallback is RLIMITs only, each per process: RLIMIT_NPROC (per uid, so shared by every sandbox of the
same uid; a fork past it fails, the exec is not killed), RLIMIT_AS for memory (allocations fail with
ENOMEM inside the command; no "memory" reason), RLIMIT_CPU (SIGXCPU at the limit, SIGKILL a second
later: the command runs as its PID namespace's pid 1, which ignores SIGXCPU); HostSupport.notes and
Sandbox.notes say which applies.
"""
from __future__ import annotations

import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from k3.envs.errors import SandboxError

MIB = 1 << 20
POLL_S = 0.02  # how often a running exec's CPU time and process events are read
DISK_POLL_S = 0.1  # how often its writable layer is measured (a directory walk: costlier)


@dataclass(frozen=True)
class Limits:
    """Per-sandbox budgets; cpu_time_s and timeout_s are per exec, the rest hold while it runs."""

    cpu_time_s: float = 10.0
    memory_bytes: int = 512 * MIB
    processes: int = 64
    file_size_bytes: int = 128 * MIB
    disk_bytes: int = 1024 * MIB
    output_bytes: int = 1 * MIB  # per stream; the rest is drained, dropped and marked
    open_files: int = 1024
    timeout_s: float = 30.0  # default wall-clock limit of exec()
    cpus: float | None = 1.0  # CPU bandwidth, in cores (cgroup cpu quota), so one sandbox cannot take the host

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "memory_bytes", "processes", "file_size_bytes", "disk_bytes",
                     "output_bytes", "open_files", "timeout_s", "cpus"):
            value = getattr(self, name)
            if value is not None and value <= 0 if name == "cpus" else value <= 0:
                raise SandboxError(f"Limits.{name} must be positive, got {value}")

    def rlimits(self, with_cgroup: bool) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) set on bwrap and inherited by every sandboxed process."""
        cpu = max(1, int(self.cpu_time_s + 0.999))
        out = [(resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL at hard
               (resource.RLIMIT_FSIZE, self.file_size_bytes, self.file_size_bytes),
               (resource.RLIMIT_NOFILE, self.open_files, self.open_files),
               (resource.RLIMIT_CORE, 0, 0)]  # a crash must not write a core file to the host
        if not with_cgroup:
            # bwrap's own helper processes count against NPROC too, hence the small headroom
            out += [(resource.RLIMIT_NPROC, self.processes + 4, self.processes + 4),
                    (resource.RLIMIT_AS, self.memory_bytes, self.memory_bytes)]
        return out


def read_control(path: Path) -> str:
    with open(path) as f:
        return f.read()


def write_control(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def control_counter(text: str, key: str) -> int:
    """A counter from a `key value` per line control file (pids.events, memory.events, cpu.stat)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


class SandboxCgroup:
    """One sandbox's cgroups, nested under this process's own: memory and cpuacct for the sandbox's
    life, pids one child group per exec, so its pids.max and its `max` event count are that exec's
    alone (nothing of an earlier exec can still be charged to it)."""

    def __init__(self, parents: dict[str, Path], name: str, limits: Limits):
        self.dirs = {c: p / name for c, p in parents.items()}
        self.limits = limits
        self._exec: Path | None = None
        self._count = 0
        made = []
        try:
            for d in self.dirs.values():
                d.mkdir(parents=True, exist_ok=True)
                made.append(d)
            memory = self.dirs["memory"]
            write_control(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (memory / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit
                write_control(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
            if "cpu" in self.dirs and limits.cpus is not None:
                write_control(self.dirs["cpu"] / "cpu.cfs_period_us", "100000")
                write_control(self.dirs["cpu"] / "cpu.cfs_quota_us", str(int(limits.cpus * 100_000)))
        except OSError as e:
            for d in made:
                remove_cgroup(d)
            raise SandboxError(f"cannot set up sandbox cgroup {name}: {e}") from e

    def start_exec(self) -> list[str]:
        """A new pids group for one exec; returns the cgroup.procs files its bwrap joins before exec."""
        self._count += 1
        self._exec = self.dirs["pids"] / f"x{self._count}"
        try:
            self._exec.mkdir()
            write_control(self._exec / "pids.max", str(self.limits.processes))
        except OSError as e:
            raise SandboxError(f"cannot make the exec's pids cgroup {self._exec}: {e}") from e
        return [str(self._exec / "cgroup.procs")] + [str(d / "cgroup.procs") for c, d in self.dirs.items() if c != "pids"]

    def counters(self) -> tuple[int, int, int]:
        """(CPU nanoseconds, pid-limit hits of the current exec, OOM kills) so far."""
        hits = control_counter(read_control(self._exec / "pids.events"), "max") if self._exec else 0
        return (int(read_control(self.dirs["cpuacct"] / "cpuacct.usage")), hits,
                control_counter(read_control(self.dirs["memory"] / "memory.oom_control"), "oom_kill"))

    def procs(self) -> list[int]:
        """Every process in the sandbox."""
        return [int(p) for p in read_control(self.dirs["memory"] / "cgroup.procs").split()]

    def kill_all(self) -> None:
        """SIGKILL every process left in the sandbox, until none is (a fork between reads is caught
        by the next round; pids.max bounds how many there can be)."""
        kill_until_empty(self.procs, self.dirs["memory"])

    def end_exec(self) -> None:
        """After bwrap's exit: kill what is left (background jobs the PID namespace's teardown has
        not reached yet) and wait until every process has left the group, i.e. has passed its
        namespace teardown, so the overlay is unmounted and the file tree still before we go on."""
        self.kill_all()
        if self._exec is not None:
            remove_cgroup(self._exec)
            self._exec = None

    def remove(self) -> None:
        self.end_exec()
        for x in self.dirs["pids"].glob("x*"):
            remove_cgroup(x)
        for d in self.dirs.values():
            remove_cgroup(d)


def sweep_stale_cgroups(parents: dict[str, Path], prefix: str, alive) -> None:
    """Remove sandbox cgroups (named `prefix<pid>-...`) whose owning process is dead: a SIGKILLed
    owner runs no cleanup, and its cgroups would otherwise stay for the host's lifetime."""
    for parent in parents.values():
        for d in parent.glob(f"{prefix}*"):
            pid = d.name[len(prefix):].split("-")[0]
            if not pid.isdigit() or alive(int(pid)):
                continue
            try:
                for child in list(d.iterdir()):
                    if child.is_dir():
                        _kill_procs(child)
                        remove_cgroup(child)
                _kill_procs(d)
                remove_cgroup(d)
            except (OSError, SandboxError):
                continue  # another process may be sweeping the same directory


def _kill_procs(d: Path) -> None:
    for pid in read_control(d / "cgroup.procs").split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_until_empty(procs, group: Path, kill_file: Path | None = None) -> None:
    """SIGKILL `procs()` (through `kill_file`, v2's cgroup.kill, where it exists) until none is left."""
    for _ in range(100):
        pids = procs()
        if not pids:
            return
        if kill_file is not None and kill_file.exists():
            write_control(kill_file, "1")
        else:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.001)
    raise SandboxError(f"sandbox cgroup {group} still has processes after SIGKILL")


def remove_cgroup(d: Path) -> None:
    """rmdir a cgroup, retrying briefly: a killed process leaves it only once it is reaped."""
    for _ in range(200):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)
    raise SandboxError(f"cgroup {d} still busy after kill")


def child_setup(procs_files: list[str], rlimits: list[tuple[int, int, int]], uid: int | None, gid: int | None):
    """The preexec_fn of bwrap: join the sandbox's cgroups (needs root), set the RLIMITs, then drop
    to the sandbox uid, all before exec, so no sandboxed process ever runs outside its limits."""

    def setup() -> None:
        for path in procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # v1: "0" moves the writing process itself
            finally:
                os.close(fd)
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        if uid is not None and gid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)

    return setup
