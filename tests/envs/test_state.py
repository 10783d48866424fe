"""Snapshots, forks, restores and pause / resume reproduce the file tree byte for byte; the layers
hold only changes; closing, an exception or the process's exit leave no directory, cgroup or process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from k3.envs import Limits, Sandbox, SandboxError, SandboxPool, layers
from k3.envs.host import probe

# files of every kind, a deletion of a lower file (a whiteout), a mode change and a symlink
BUILD = textwrap.dedent("""\
    mkdir -p src/pkg data && printf 'print(1)\\n' > src/main.py && head -c 300000 /dev/urandom > data/blob
    ln -s ../data/blob src/link && chmod 600 src/main.py && echo gone > /tmp/scratch && touch -d @1 data
""")
CHANGE = "rm -r data /tmp/scratch; echo changed >> src/main.py; chmod 755 src; ln -sf /etc/hosts src/link; mkdir new"


def test_fork_reproduces_the_tree_and_diverges_independently(make_sandbox):
    parent = make_sandbox()
    assert parent.exec(BUILD).ok
    before = parent.digest()
    child = parent.fork()
    assert child.digest() == before
    assert parent.exec(CHANGE).ok and child.digest() == before  # the parent's writes stay its own
    assert child.exec("echo child > only-child").ok and parent.exec("test -e only-child").code == 1
    child.close()


def test_restore_after_changes_and_a_failure(make_sandbox):
    sandbox = make_sandbox()
    sandbox.exec(BUILD)
    snap, before = sandbox.snapshot(), sandbox.digest()
    sandbox.exec(CHANGE)
    assert sandbox.digest() != before
    sandbox.exec("rm -rf ~/* /tmp/*; exit 3")  # an episode that wrecked its tree and failed
    sandbox.restore(snap)
    assert sandbox.digest() == before
    other = sandbox.fork(snap)
    assert other.digest() == before
    other.close()


def test_snapshots_are_incremental(make_sandbox):
    sandbox = make_sandbox()
    sandbox.exec("head -c 2M /dev/urandom > big")
    first = sandbox.snapshot()
    sandbox.exec("echo small > small")
    sandbox.snapshot()
    top = sandbox.stack[-1]
    assert sorted(p.name for p in top.rglob("*") if p.is_file()) == ["small"]  # only the change
    assert layers.tree_bytes(top) < 64 << 10
    assert sandbox.snapshot() and sandbox.stack[-1] == top  # nothing changed: no new layer
    sandbox.restore(first)
    assert sandbox.exec("ls").text.split() == ["big"]


def test_deep_stacks_are_squashed_exactly(make_sandbox, monkeypatch):
    monkeypatch.setattr(layers, "MAX_DEPTH", 3)
    sandbox = make_sandbox()
    sandbox.exec(BUILD)
    snaps = []
    for i in range(5):
        sandbox.exec(f"echo {i} >> log; rm -f f{i - 1}; echo x > f{i}")
        snaps.append((sandbox.snapshot(), sandbox.digest()))
    assert len(sandbox.stack) <= 3
    for snap, digest in snaps:
        sandbox.restore(snap)
        assert sandbox.digest() == digest


def test_pause_holds_nothing_and_resume_continues_exactly(make_sandbox):
    sandbox = make_sandbox()
    marker = f"sleep 30.{os.getpid()}{time.monotonic_ns() % 10**6}"  # this test's own, not another run's sleep
    sandbox.exec(f"echo 1 > counter; {marker} &")  # a background job does not outlive its exec
    before = sandbox.digest()
    cgroup = sandbox._cgroup
    sandbox.pause()
    if cgroup is not None:
        assert not any(d.exists() for d in cgroup.dirs.values())  # no cgroup, so no process either
    assert not any(marker in _cmdline(pid) for pid in _host_pids())
    with pytest.raises(SandboxError, match="paused"):
        sandbox.exec("true")
    sandbox.resume()
    assert sandbox.digest() == before
    assert sandbox.exec("echo $(( $(cat counter) + 1 )) > counter; cat counter").text == "2\n"


def test_close_removes_directories_and_cgroups(make_sandbox):
    sandbox = make_sandbox()
    sandbox.exec("echo x > a")
    sandbox.snapshot()
    child = sandbox.fork()
    root, cgroups = sandbox.store.root, list(sandbox._cgroup.dirs.values()) if sandbox._cgroup else []
    sandbox.close()
    assert root.exists()  # the fork still stands on the shared layers
    child.close()
    assert not root.exists() and not any(d.exists() for d in cgroups)
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")


def test_an_exception_inside_the_with_block_cleans_up(sandbox_support):
    with pytest.raises(RuntimeError, match="episode failed"), Sandbox() as sandbox:
        root = sandbox.store.root
        sandbox.exec("echo x > a")
        raise RuntimeError("episode failed")
    assert not root.exists()


def _child_program(kill: bool) -> str:
    return textwrap.dedent(f"""\
        import os, signal
        from k3.envs import Sandbox
        s = Sandbox()
        s.exec("echo x > a")
        print(s.store.root, flush=True)
        if {kill}:
            os.kill(os.getpid(), signal.SIGKILL)
    """)


def test_process_exit_and_sigkill_leave_nothing(sandbox_support):
    cwd = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _child_program(False)], capture_output=True, text=True, cwd=cwd,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert not Path(done.stdout.strip()).exists()  # closed by the atexit hook
    killed = subprocess.run([sys.executable, "-c", _child_program(True)], capture_output=True, text=True, cwd=cwd,
                          check=False)
    assert killed.returncode == -signal.SIGKILL
    stale = Path(killed.stdout.strip())
    stale_cgroups = [d for parent in probe().cgroup_dirs.values() for d in parent.glob(f"{stale.name}-*")]
    assert stale.exists() and len(stale_cgroups) == len(probe().cgroup_dirs)  # nothing runs at SIGKILL...
    Sandbox().close()  # ...so the next store made on the host sweeps them
    assert not stale.exists() and not any(d.exists() for d in stale_cgroups)


def test_pool_hands_out_and_reclaims_clean_sandboxes(sandbox_support):
    with SandboxPool(size=2, limits=Limits(processes=16)) as pool:
        root = pool.store.root
        assert pool.idle == 2
        a = pool.acquire()
        a.exec("echo dirty > mess")
        a.snapshot()
        a.close()
        assert pool.idle == 2 and not a.closed
        b, c, d = pool.acquire(), pool.acquire(), pool.acquire()  # the third is made on demand
        assert all(s.exec("ls").text == "" for s in (b, c, d))
        for s in (b, c, d):
            s.close()
        assert pool.idle == 2 and d.closed
        assert b.limits.processes == 16
    assert not root.exists() and b.closed


def _host_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
