"""Whole-sandbox limits on a cgroup v2 (unified) host: the same budgets as the v1 groups of
k3/envs/limits.py, with v2's files.

Layout, under D, this process's own cgroup (the hierarchy's mount + the `0::` line of
/proc/self/cgroup), with memory, pids and (when offered) cpu enabled in D's cgroup.subtree_control:
  D/k3-envs-<pid>-...-<sandbox>      memory.max, memory.swap.max 0, cpu.max; +pids for its children
  D/k3-envs-<pid>-...-<sandbox>/x<n> one leaf per exec with pids.max: every sandboxed process is here
v2 lets no cgroup with enabled controllers hold processes ("no internal processes"), so D's
controllers can be enabled only once D is empty but for its children: when this process is alone in
D it first moves itself into the leaf D/k3-envs-<pid>-self (swept like any group of a dead owner);
when D holds other processes too, the probe reports that (and RLIMITs apply) rather than moving
processes that are not ours. The readings: cpu.stat usage_usec (CPU time, all descendants),
memory.events oom_kill, the leaf's pids.events max; a kill is one write to cgroup.kill (kernel 5.14+,
else SIGKILL to each process listed).
"""
from __future__ import annotations

import os
from pathlib import Path

from k3.envs.errors import SandboxError
from k3.envs.limits import (
    SandboxCgroup,
    control_counter,
    kill_until_empty,
    read_control,
    remove_cgroup,
    write_control,
)

NEEDED = ("memory", "pids")  # without these, no v2 limits; cpu (for cpu.max) is used when offered
MOUNTINFO, PROC_CGROUP = Path("/proc/self/mountinfo"), Path("/proc/self/cgroup")




def own_cgroup(mountinfo: Path = MOUNTINFO, proc_cgroup: Path = PROC_CGROUP) -> Path | None:
    """This process's directory in the v2 hierarchy, if one is mounted."""
    mount = None
    for line in read_control(mountinfo).splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            mount = Path(left.split()[4])
            break
    if mount is None:
        return None
    for line in read_control(proc_cgroup).splitlines():
        if line.startswith("0::"):
            return mount / line[3:].lstrip("/")
    return None


def delegate(own: Path, prefix: str, pid: int | None = None) -> tuple[Path | None, str]:
    """(D, "") with the controllers enabled in D = `own` for sandbox groups under it, or (None, why)."""
    pid = os.getpid() if pid is None else pid
    offered = read_control(own / "cgroup.controllers").split()
    missing = [c for c in NEEDED if c not in offered]
    if missing:
        return None, f"cgroup v2: {own} offers no {'/'.join(missing)} controller (cgroup.controllers: {offered})"
    wanted = " ".join(f"+{c}" for c in (*NEEDED, "cpu") if c in offered)
    if all(c in read_control(own / "cgroup.subtree_control").split() for c in NEEDED):
        return own, ""
    procs = read_control(own / "cgroup.procs").split()
    if procs and procs != [str(pid)]:
        return None, (f"cgroup v2: {own} holds {len(procs)} processes, not only this one, so its controllers cannot "
                      "be enabled for sandbox groups (run k3 in a cgroup of its own, e.g. systemd-run --scope "
                      "-p Delegate=yes)")
    try:
        if procs:  # alone here: step into a leaf of our own so `own` may enable controllers
            leaf = own / f"{prefix}{pid}-self"
            leaf.mkdir(exist_ok=True)
            write_control(leaf / "cgroup.procs", str(pid))
        write_control(own / "cgroup.subtree_control", wanted)
    except OSError as e:
        return None, f"cgroup v2: cannot enable {wanted} in {own}: {e.strerror}"
    return own, ""


class SandboxCgroupV2(SandboxCgroup):
    """One sandbox's v2 group under D (see the module docstring): the v1 SandboxCgroup of
    k3/envs/limits.py with v2's files (its end_exec is shared)."""

    def __init__(self, parents: dict[str, Path], name: str, limits):
        self.group = parents["unified"] / name
        self.dirs = {"unified": self.group}
        self.limits = limits
        self._exec: Path | None = None
        self._count = 0
        try:
            self.group.mkdir()
        except OSError as e:
            raise SandboxError(f"cannot make sandbox cgroup {self.group}: {e}") from e
        try:
            write_control(self.group / "memory.max", str(limits.memory_bytes))
            if (self.group / "memory.swap.max").exists():  # no swapping past the limit
                write_control(self.group / "memory.swap.max", "0")
            if limits.cpus is not None and "cpu" in read_control(parents["unified"] / "cgroup.subtree_control").split():
                write_control(self.group / "cpu.max", f"{int(limits.cpus * 100_000)} 100000")
            write_control(self.group / "cgroup.subtree_control", "+pids")
        except OSError as e:
            remove_cgroup(self.group)
            raise SandboxError(f"cannot set up sandbox cgroup {self.group}: {e}") from e

    def start_exec(self) -> list[str]:
        """A new leaf with pids.max for one exec; returns the cgroup.procs file its bwrap joins."""
        self._count += 1
        self._exec = self.group / f"x{self._count}"
        try:
            self._exec.mkdir()
            write_control(self._exec / "pids.max", str(self.limits.processes))
        except OSError as e:
            raise SandboxError(f"cannot make the exec's cgroup {self._exec}: {e}") from e
        return [str(self._exec / "cgroup.procs")]

    def counters(self) -> tuple[int, int, int]:
        """(CPU nanoseconds, pid-limit hits of the current exec, OOM kills) so far."""
        hits = control_counter(read_control(self._exec / "pids.events"), "max") if self._exec else 0
        return (control_counter(read_control(self.group / "cpu.stat"), "usage_usec") * 1000, hits,
                control_counter(read_control(self.group / "memory.events"), "oom_kill"))

    def procs(self) -> list[int]:
        """Every process in the sandbox (they all sit in exec leaves)."""
        return [int(p) for leaf in self.group.glob("x*") for p in read_control(leaf / "cgroup.procs").split()]

    def kill_all(self) -> None:
        """SIGKILL every process in the sandbox and wait until none is left."""
        kill_until_empty(self.procs, self.group, self.group / "cgroup.kill")

    def remove(self) -> None:
        self.end_exec()
        for leaf in self.group.glob("x*"):
            remove_cgroup(leaf)
        remove_cgroup(self.group)
