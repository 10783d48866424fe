"""CPU threads that fit the machine, chosen before torch is imported, and followed while it runs.

torch's default is one intra-op thread per core with OpenMP threads that spin-wait at the end of
every parallel region. On a quiet machine that is the fastest setting (bench/cpu_contention.py
--sweep: 2 spinning threads train k3-tiny in 0.73 s/step against 1.15 s for one thread), but when
another process competes for the cores, spinning threads steal the time the one doing the work
needs and a step collapses (2 spinning threads beside one busy process: 3.5x slower). So k3 uses
every CPU the process may use (its affinity mask, capped by a cgroup quota) with a bounded spin
(`GOMP_SPINCOUNT`, so a thread the count no longer uses sleeps soon), and `adapt()`, called by the
training loop and the serving engine between steps, gives other processes' load its share: every
ADAPT_EVERY_S it reads how much CPU time other processes took on this process's CPUs
(/proc/stat less /proc/self/stat) and runs max(1, cpus - ceil(others - OTHERS_SLACK)) threads.
Both environment settings must be there before torch (and with it libgomp) is first loaded:
`k3.cli` calls `configure` first.

Precedence: `--threads N` > `K3_NUM_THREADS` > `OMP_NUM_THREADS` (respected if set) > auto; only
"auto" adapts. A wait policy the user set (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`) is kept.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# what `configure` last wrote to OMP_NUM_THREADS: a later choice in this process (or a child that
# inherits the environment) chooses again instead of taking it for the user's setting
WRITTEN_MARK = "K3_CHOSE_OMP_NUM_THREADS"


SPIN_COUNT = "300000"  # libgomp's own default spin (~0.1 ms): idle gaps inside a step stay hot
ADAPT_EVERY_S = 0.5  # how often adapt() re-reads the load: a step of k3-tiny takes ~1 s
OTHERS_SLACK = 0.5  # CPUs of other processes' use that still count as a quiet machine (noise, a shell)
SERVING_VERBS = ("serve", "chat")  # their event loop needs a core of its own beside the engine's threads


class ThreadsError(ValueError):
    """A thread count that is not a positive integer."""


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cpus: int  # CPUs available to this process
    source: str  # "--threads", "K3_NUM_THREADS", "OMP_NUM_THREADS" or "auto"
    wait_policy: str  # e.g. "GOMP_SPINCOUNT=300000" or "OMP_WAIT_POLICY=PASSIVE"

    adapts: bool = False  # adapt() yields threads to other processes' load (the automatic choice)

    def describe(self) -> str:
        """One line, e.g. `k3: 2 threads (2 CPUs available; GOMP_SPINCOUNT=300000; fewer while ...)`."""
        noun = "thread" if self.threads == 1 else "threads"
        via = "" if self.source == "auto" else f"from {self.source}; "
        cpus = f"{self.cpus} CPU{'' if self.cpus == 1 else 's'} available"
        adapts = "; fewer while other processes use them" if self.adapts else ""
        return f"k3: {self.threads} {noun} ({via}{cpus}; {self.wait_policy}{adapts})"


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


def choose(cli_threads: int | str | None = None, environ=None, cpus: int | None = None,
           serving: bool = False) -> ThreadChoice:
    """The thread count and wait policy for this process, without changing anything. `serving`: a
    server's event loop (HTTP, detokenizing) runs beside the engine, so the engine leaves it a CPU
    (bench/cpu_contention.py --sweep on 2 CPUs: 256-token replies 2.4 s at one thread, 2.7-3.6 s
    at two)."""
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
        # every CPU (adapt() yields to other processes); ranks of one torchrun job on one host share them
        threads = (cpus - serving if cpus > 1 else 1) if local_ranks == 1 else max(1, cpus // local_ranks)
        source = "auto"
    if environ.get("OMP_WAIT_POLICY"):
        wait = f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    elif environ.get("GOMP_SPINCOUNT"):
        wait = f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}"
    else:
        wait = f"GOMP_SPINCOUNT={SPIN_COUNT}"
    # torchrun's ranks on one host would each take the others for competition: they keep their share
    adapts = source == "auto" and threads > 1 and int(environ.get("LOCAL_WORLD_SIZE") or 1) == 1
    return ThreadChoice(threads=threads, cpus=cpus, source=source, wait_policy=wait, adapts=adapts)


def configure(cli_threads: int | str | None = None, environ=None, serving: bool = False) -> ThreadChoice:
    """Choose, then put the choice in the environment (read when torch loads) and, if torch is
    already loaded (a test, a notebook), into torch directly. Returns the choice."""
    environ = os.environ if environ is None else environ
    choice = choose(cli_threads, environ, serving=serving)
    environ["OMP_NUM_THREADS"] = environ[WRITTEN_MARK] = str(choice.threads)
    if choice.wait_policy == f"GOMP_SPINCOUNT={SPIN_COUNT}":
        environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    global _adapter
    _adapter = LoadAdapter(choice.threads) if choice.adapts and environ is os.environ else None
    if "torch" in sys.modules:
        import torch

        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
    return choice


def _busy_seconds(cpus: set[int]) -> tuple[float, float] | None:
    """(busy CPU seconds of `cpus` since boot, CPU seconds of this process) from /proc; None off Linux."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        machine = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                    machine += user + nice + system + irq + softirq + steal
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return machine / tick, (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class LoadAdapter:
    """The thread count that leaves other processes their share of this process's CPUs."""

    def __init__(self, threads: int, clock=time.monotonic, read=_busy_seconds):
        self.max_threads = self.threads = threads
        self.clock, self.read = clock, read
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))
        self._last: tuple[float, float, float] | None = None

    def poll(self) -> int:
        """Re-read the load if ADAPT_EVERY_S has passed; returns the thread count to run."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < ADAPT_EVERY_S:
            return self.threads
        sample = self.read(self.cpus)
        if sample is None:
            return self.threads
        if self._last is not None:
            then, machine, ours = self._last
            others = max(0.0, (sample[0] - machine) - (sample[1] - ours)) / (now - then)
            self.threads = max(1, min(self.max_threads, len(self.cpus) - math.ceil(others - OTHERS_SLACK)))
        self._last = (now, *sample)
        return self.threads


_adapter: LoadAdapter | None = None


def adapt() -> None:
    """Between steps, on the thread that computes: follow the machine's load (k3's automatic choice
    only; an explicit count stays). torch's thread count is per calling thread under OpenMP."""
    if _adapter is None:
        return
    threads = _adapter.poll()
    import torch  # loaded already: adapt() runs between steps of torch work

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
