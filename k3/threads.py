"""CPU threads that fit the machine, chosen before torch is imported.

torch's default is one intra-op thread per core of the machine, with OpenMP threads that
spin-wait at the end of every parallel region. When the process may use fewer CPUs than the
machine has (an affinity mask, a container's cgroup quota) or another process competes for the
cores, spinning threads steal the time the one doing the work needs and a step collapses by an
order of magnitude. So `configure` makes OpenMP threads sleep when idle (`OMP_WAIT_POLICY=PASSIVE`)
and picks the thread count from the CPUs actually available, leaving one to the rest of the
machine: with sleeping threads, every parallel region pays a wake-up, and on a 2-CPU machine one
thread trains k3-tiny as fast as two and decodes faster (bench/cpu_contention.py). Both must be in the
environment before torch (and with it libgomp) is first loaded: `k3.cli` calls this first.

Precedence: `--threads N` > `K3_NUM_THREADS` > `OMP_NUM_THREADS` (respected if set) > auto.
A wait policy the user set (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`) is kept.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# what `configure` last wrote to OMP_NUM_THREADS: a later choice in this process (or a child that
# inherits the environment) chooses again instead of taking it for the user's setting
WRITTEN_MARK = "K3_CHOSE_OMP_NUM_THREADS"


class ThreadsError(ValueError):
    """A thread count that is not a positive integer."""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cpus: int  # CPUs available to this process
    source: str  # "--threads", "K3_NUM_THREADS", "OMP_NUM_THREADS" or "auto"
    wait_policy: str  # e.g. "OMP_WAIT_POLICY=PASSIVE" or "GOMP_SPINCOUNT=0"

    def describe(self) -> str:
        """One line, e.g. `k3: 2 threads (2 CPUs available; OMP_WAIT_POLICY=PASSIVE)`."""
        noun = "thread" if self.threads == 1 else "threads"
        via = "" if self.source == "auto" else f"from {self.source}; "
        cpus = f"{self.cpus} CPU{'' if self.cpus == 1 else 's'} available"
        return f"k3: {self.threads} {noun} ({via}{cpus}; {self.wait_policy})"


def _cgroup_v2_limit(root: Path, rel: str) -> float | None:
    """The tightest `cpu.max` quota from the process's cgroup up to the root, in CPUs."""
    limits = []
    folder = root / rel.lstrip("/")
    while True:
        try:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    return min(limits) if limits else None


def _cgroup_v1_limit(root: Path, rel: str) -> float | None:
    for controller in ("cpu", "cpu,cpuacct"):
        for folder in (root / controller / rel.lstrip("/"), root / controller):
            try:
                quota = int((folder / "cpu.cfs_quota_us").read_text())
                period = int((folder / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                return quota / period
            break  # -1: no quota at this level
    return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs allowed by the cgroup quota (v2 `cpu.max`, else v1 `cpu.cfs_quota_us`); None: no quota."""
    v2_rel, v1_rel = "/", "/"
    try:
        for line in proc_cgroup.read_text().splitlines():
            hierarchy, controllers, rel = line.split(":", 2)
            if hierarchy == "0" and controllers == "":
                v2_rel = rel
            elif "cpu" in controllers.split(","):
                v1_rel = rel
    except (OSError, ValueError):
        pass
    if (root / "cgroup.controllers").is_file():
        return _cgroup_v2_limit(root, v2_rel)
    return _cgroup_v1_limit(root, v1_rel)


def available_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by a cgroup quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _positive_int(value: str | int, what: str) -> int:
    try:
        n = int(str(value).split(",")[0].strip())  # OMP_NUM_THREADS may list nested levels: "4,2"
    except ValueError:
        n = 0
    if n < 1:
        raise ThreadsError(f"{what} must be a positive integer, got {value!r}")
    return n


def _torchrun_default(environ) -> bool:
    """torchrun sets OMP_NUM_THREADS=1 for every rank of a multi-rank job when the user did not set
    it; that is its placeholder, not a choice, so the per-rank share of the host's CPUs applies."""
    return (bool(environ.get("TORCHELASTIC_RUN_ID")) and environ.get("OMP_NUM_THREADS") == "1"
            and int(environ.get("LOCAL_WORLD_SIZE") or 1) > 1)


def choose(cli_threads: int | str | None = None, environ=None, cpus: int | None = None) -> ThreadChoice:
    """The thread count and wait policy for this process, without changing anything."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus() if cpus is None else cpus
    if cli_threads is not None:
        threads, source = _positive_int(cli_threads, "--threads"), "--threads"
    elif environ.get("K3_NUM_THREADS"):
        threads, source = _positive_int(environ["K3_NUM_THREADS"], "K3_NUM_THREADS"), "K3_NUM_THREADS"
    elif environ.get("OMP_NUM_THREADS") and environ.get("OMP_NUM_THREADS") != environ.get(WRITTEN_MARK) \
            and not _torchrun_default(environ):
        threads, source = _positive_int(environ["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), "OMP_NUM_THREADS"
    else:
        local_ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
        # one CPU left to the rest of the machine; ranks of one torchrun job on one host share its CPUs
        threads = max(1, cpus - 1) if local_ranks == 1 else max(1, cpus // local_ranks)
        source = "auto"
    if environ.get("OMP_WAIT_POLICY"):
        wait = f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    elif environ.get("GOMP_SPINCOUNT"):
        wait = f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}"
    else:
        wait = "OMP_WAIT_POLICY=PASSIVE"
    return ThreadChoice(threads=threads, cpus=cpus, source=source, wait_policy=wait)


def configure(cli_threads: int | str | None = None, environ=None) -> ThreadChoice:
    """Choose, then put the choice in the environment (read when torch loads) and, if torch is
    already loaded (a test, a notebook), into torch directly. Returns the choice."""
    environ = os.environ if environ is None else environ
    choice = choose(cli_threads, environ)
    environ["OMP_NUM_THREADS"] = environ[WRITTEN_MARK] = str(choice.threads)
    if choice.wait_policy == "OMP_WAIT_POLICY=PASSIVE":
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" in sys.modules:
        import torch

        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
    return choice
