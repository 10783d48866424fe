"""The cgroup v2 backend (k3/envs/cgroup_v2.py) against a fake cgroup tree: the hosts these tests
run on mount v1 (hybrid: their v2 hierarchy has no controllers), so the kernel's side is played by
plain files and only what k3 reads and writes is checked."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from k3.envs import Limits, SandboxError
from k3.envs import cgroup_v2 as v2


def fake_cgroup(path: Path, controllers: str = "cpuset cpu io memory pids", procs: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in (("cgroup.controllers", controllers), ("cgroup.subtree_control", ""), ("cgroup.procs", procs)):
        (path / name).write_text(text)
    return path


def test_own_cgroup_reads_the_v2_mount_and_this_process_path(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("30 1 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n")
    (tmp_path / "cgroup").write_text("0::/user.slice/k3.scope\n")
    assert v2.own_cgroup(mountinfo, tmp_path / "cgroup") == Path("/sys/fs/cgroup/user.slice/k3.scope")
    mountinfo.write_text("31 1 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    assert v2.own_cgroup(mountinfo, tmp_path / "cgroup") is None  # v1 only


def test_delegation_moves_only_this_process_and_enables_the_controllers(tmp_path):
    alone = fake_cgroup(tmp_path / "alone", procs="4242\n")
    assert v2.delegate(alone, "k3-envs-", pid=4242) == (alone, "")
    assert (alone / "k3-envs-4242-self" / "cgroup.procs").read_text() == "4242"  # stepped into a leaf
    assert (alone / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"

    shared = fake_cgroup(tmp_path / "shared", procs="4242\n77\n")
    parent, why = v2.delegate(shared, "k3-envs-", pid=4242)
    assert parent is None and "holds 2 processes, not only this one" in why
    assert (shared / "cgroup.subtree_control").read_text() == "" and not list(shared.glob("k3-envs-*"))

    bare = fake_cgroup(tmp_path / "bare", controllers="cpu io")
    why = f"cgroup v2: {bare} offers no memory/pids controller (cgroup.controllers: ['cpu', 'io'])"
    assert v2.delegate(bare, "k3-envs-", pid=4242) == (None, why)
    ready = fake_cgroup(tmp_path / "ready", controllers="memory pids")
    (ready / "cgroup.subtree_control").write_text("memory pids\n")
    assert v2.delegate(ready, "k3-envs-", pid=4242) == (ready, "")  # delegated already: nothing written


def test_sandbox_group_files(tmp_path, monkeypatch):
    remove = lambda d: shutil.rmtree(d, ignore_errors=True)  # the kernel's files go with a group
    monkeypatch.setattr(v2, "remove_cgroup", remove)
    monkeypatch.setattr("k3.envs.limits.remove_cgroup", remove)  # end_exec is the v1 class's
    parent = fake_cgroup(tmp_path / "d")
    (parent / "cgroup.subtree_control").write_text("memory pids cpu\n")
    cg = v2.SandboxCgroupV2({"unified": parent}, "k3-envs-1-ab-cd", Limits(memory_bytes=64 << 20, processes=32, cpus=0.5))
    group = parent / "k3-envs-1-ab-cd"
    assert cg.dirs == {"unified": group}
    assert [(group / f).read_text() for f in ("memory.max", "cpu.max", "cgroup.subtree_control")] == \
           [str(64 << 20), "50000 100000", "+pids"]
    assert cg.start_exec() == [str(group / "x1" / "cgroup.procs")]  # one file joins every controller
    assert (group / "x1" / "pids.max").read_text() == "32"
    (group / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (group / "x1" / "pids.events").write_text("max 2\n")
    (group / "x1" / "cgroup.procs").write_text("")
    assert cg.counters() == (1_500_000, 2, 1)
    cg.end_exec()
    assert not (group / "x1").exists() and cg.start_exec()[0].endswith("x2/cgroup.procs")
    (group / "x2" / "cgroup.procs").write_text("")
    cg.remove()
    assert not group.exists()


def test_a_group_that_cannot_be_made_is_a_one_line_error(tmp_path):
    with pytest.raises(SandboxError, match="cannot make sandbox cgroup"):
        v2.SandboxCgroupV2({"unified": tmp_path / "missing"}, "k3-envs-1-x", Limits())


def test_stale_v2_groups_of_dead_owners_are_swept(tmp_path, monkeypatch):
    from k3.envs.limits import sweep_stale_cgroups
    monkeypatch.setattr("k3.envs.limits.remove_cgroup", lambda d: shutil.rmtree(d, ignore_errors=True))
    parent = fake_cgroup(tmp_path / "d")
    for name in ("k3-envs-999999-self", "k3-envs-999999-ab-cd", f"k3-envs-{os.getpid()}-ab-cd"):
        fake_cgroup(parent / name)
    fake_cgroup(parent / "k3-envs-999999-ab-cd" / "x3")
    sweep_stale_cgroups({"unified": parent}, "k3-envs-", lambda pid: pid == os.getpid())
    assert sorted(p.name for p in parent.glob("k3-envs-*")) == [f"k3-envs-{os.getpid()}-ab-cd"]
