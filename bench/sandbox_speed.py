"""k3.envs sandbox operations on a 50 MB writable layer, each the median of `--n` (default 100), beside
plain-`subprocess` floors in a temp directory: a no-op exec against `subprocess.run`, snapshot and
fork against copying the same 50 MB tree (`cp -a`, what a copy-based snapshot would cost).

  python -m bench.sandbox_speed [--n 100] [--mb 50]

Rows: snapshot of 50 MB of fresh changes (the upper frozen as a layer), snapshot of a small change on
top of it (incremental), fork of a snapshot, fork of the live tree, restore, resume after pause, and
the no-op exec round trip (`/usr/bin/true` as an argv, and `true` through /bin/sh).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from k3.envs import Limits, Sandbox

TARGETS_MS = {"snapshot": 100, "fork": 100, "resume": 50, "exec": 50}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def summary(samples: list[float]) -> tuple[float, float, float]:
    """(median, p90, max) in ms; max shows the rare squash (every layers.MAX_DEPTH snapshots)."""
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], ordered[-1]


def fill(sandbox: Sandbox, mb: int) -> None:
    """`mb` MB of changes in the sandbox's upper: 1 MB files (the kind of tree an agent writes)."""
    done = sandbox.exec(f"mkdir -p work && head -c {mb}M /dev/urandom | split -b 1M - work/f", timeout=120)
    if not done.ok:
        raise SystemExit(f"could not write the {mb} MB layer: {done.killed_reason or done.stderr!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--mb", type=int, default=50)
    args = parser.parse_args()
    n, mb = args.n, args.mb
    limits = Limits(disk_bytes=(4 * mb + 64) << 20, file_size_bytes=(mb + 1) << 20, timeout_s=120)
    rows: list[tuple[str, list[float], list[float] | None, str]] = []

    with Sandbox(limits) as sandbox:
        empty = sandbox.snapshot()
        big = []  # snapshot of mb MB of fresh changes: back to empty, write them, freeze them
        for _ in range(n):
            sandbox.restore(empty)
            fill(sandbox, mb)
            start = time.perf_counter()
            snap = sandbox.snapshot()
            big.append((time.perf_counter() - start) * 1e3)
            sandbox.drop_snapshot(snap)
        sandbox.restore(empty)
        fill(sandbox, mb)
        base = sandbox.snapshot()
        small, snaps = [], []
        for i in range(n):
            sandbox.exec(f"echo {i} >> log")
            small.append(timed(lambda: snaps.append(sandbox.snapshot())))
        for snap in snaps:
            sandbox.drop_snapshot(snap)
        sandbox.restore(base)

        fork_snap, fork_live = [], []
        for _ in range(n):
            start = time.perf_counter()
            child = sandbox.fork(base)
            fork_snap.append((time.perf_counter() - start) * 1e3)
            child.close()
        for i in range(n):
            sandbox.exec(f"echo {i} > live")
            start = time.perf_counter()
            child = sandbox.fork()
            fork_live.append((time.perf_counter() - start) * 1e3)
            child.close()
        restore = []
        for _ in range(n):
            sandbox.exec("echo change > change")
            restore.append(timed(lambda: sandbox.restore(base)))
        resume = []
        for _ in range(n):
            sandbox.pause()
            resume.append(timed(sandbox.resume))
        exec_argv = [timed(lambda: sandbox.exec(["/usr/bin/true"])) for _ in range(n)]
        exec_sh = [timed(lambda: sandbox.exec("true")) for _ in range(n)]
        assert sandbox.exec("du -sm work | cut -f1").text.strip() in (str(mb), str(mb + 1))

    with tempfile.TemporaryDirectory(prefix="k3-bench-floor-") as tmp:
        src = Path(tmp, "src")
        src.mkdir()
        for i in range(mb):
            Path(src, f"f{i}").write_bytes(bytes(1 << 20))
        copies = []
        for i in range(n):
            copies.append(timed(lambda: subprocess.run(["cp", "-a", str(src), f"{tmp}/copy"], check=True)))
            shutil.rmtree(f"{tmp}/copy")
        floor_exec = [timed(lambda: subprocess.run(["/usr/bin/true"], cwd=tmp, check=True)) for _ in range(n)]
        floor_sh = [timed(lambda: subprocess.run("true", shell=True, cwd=tmp, check=True)) for _ in range(n)]

    rows += [(f"snapshot, {mb} MB of new changes", big, copies, "snapshot"),
             ("snapshot, a small change on top", small, copies, "snapshot"),
             (f"fork of a snapshot ({mb} MB layer)", fork_snap, copies, "fork"),
             ("fork of the live tree", fork_live, copies, "fork"),
             ("restore", restore, copies, "snapshot"),
             ("resume after pause", resume, None, "resume"),
             ("no-op exec, argv /usr/bin/true", exec_argv, floor_exec, "exec"),
             ("no-op exec, sh -c true", exec_sh, floor_sh, "exec")]
    print(f"\nk3.envs sandbox speed: median (p90, max) of {n}, ms; floor = plain subprocess in a temp dir "
          f"(cp -a of the {mb} MB tree for snapshot / fork / restore)")
    print(f"{'operation':38} {'k3.envs':>22} {'floor':>22} {'target':>8}")
    for name, samples, floor, kind in rows:
        med, p90, top = summary(samples)
        floor_text = "{:.1f} ({:.1f}, {:.1f})".format(*summary(floor)) if floor else "-"
        verdict = "ok" if med <= TARGETS_MS[kind] else "MISSED"
        print(f"{name:38} {f'{med:.1f} ({p90:.1f}, {top:.1f})':>22} {floor_text:>22} {f'<= {TARGETS_MS[kind]}':>8} {verdict}")


if __name__ == "__main__":
    main()
