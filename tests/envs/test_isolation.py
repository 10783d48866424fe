"""A sandboxed command reaches nothing of the host (files, network, processes, privileges, denied
system calls) and is stopped at its CPU, memory, process, file-size and disk limits with a clear reason."""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path

import pytest

import k3.envs.sandbox as sandbox_module
from k3.envs import Limits, Sandbox
from k3.envs.host import HostSupport, probe

SECRET = "host-secret-9f2c"


def test_host_files_are_neither_readable_nor_writable(make_sandbox, tmp_path):
    (tmp_path / "secret.txt").write_text(SECRET)
    sandbox = make_sandbox()
    probe = (f"cat {tmp_path}/secret.txt; cat /work/main/pyproject.toml; ls /root; ls /work; ls /sys; "
             "grep -c . /etc/passwd; cat /etc/shadow")
    result = sandbox.exec(probe)
    assert SECRET not in result.text and "build-system" not in result.text
    assert "No such file" in result.stderr.decode()
    assert sandbox.exec("grep -c . /etc/passwd").text.strip() == "3"  # the base image's own passwd
    for target in ("/usr/bin/evil", "/usr/lib/evil", "/etc/ld.so.cache", "/proc/sysrq-trigger"):
        assert sandbox.exec(f"echo x > {target}").code != 0, target
    assert not Path("/usr/bin/evil").exists()


def test_other_sandboxes_are_invisible(make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    a.write_file("mine.txt", SECRET)
    found = b.exec(f"grep -rl --exclude-dir=usr --exclude-dir=proc {SECRET} / 2>/dev/null; ls {a.upper} {a.store.root}")
    assert SECRET not in found.text and found.code != 0
    assert b.exec("cat mine.txt").code != 0


def test_no_network_not_even_the_hosts_loopback(make_sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        sandbox = make_sandbox()
        script = ("import socket\n"
                  "print(sorted(n for _, n in socket.if_nameindex()))\n"
                  "s = socket.socket(); s.settimeout(2)\n"
                  f"print(s.connect_ex(('127.0.0.1', {port})))\n"
                  "print(socket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect_ex(('1.1.1.1', 53)))\n")
        result = sandbox.exec(["/usr/bin/python3", "-c", script])
        interfaces, tcp, udp = result.text.splitlines()
        assert interfaces == "['lo']"  # a fresh network namespace: its own loopback, nothing else
        assert int(tcp) != 0 and int(udp) != 0  # ECONNREFUSED here, ENETUNREACH outside
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


def test_host_processes_are_invisible(make_sandbox):
    result = make_sandbox().exec("ps -eo pid,comm --no-headers")
    pids = [line.split() for line in result.text.splitlines()]
    assert len(pids) <= 4 and all(int(pid) < 10 for pid, _ in pids), result.text
    assert "python" not in result.text and "pytest" not in result.text
    assert make_sandbox().exec(f"kill -0 {os.getpid()}").code != 0


def test_runs_unprivileged_without_capabilities(make_sandbox):
    sandbox = make_sandbox()
    status = sandbox.exec("id -u; id -g; grep -E '^(Cap|NoNewPrivs)' /proc/self/status").text.splitlines()
    assert status[0] == str(sandbox.uid) != "0" and status[1] == str(sandbox.gid) != "0"
    fields = dict(line.split(":\t") for line in status[2:])
    assert all(int(fields[k], 16) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
    assert fields["NoNewPrivs"] == "1"
    assert sandbox.exec("unshare -U true").code != 0  # no nested user namespace to regain caps in
    sandbox.write_file("owned.txt", "x")
    assert (sandbox.upper / "home/agent/owned.txt").stat().st_uid == sandbox.uid  # on the host too


SYSCALLS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, nr in zip(sys.argv[1::2], sys.argv[2::2]):
    r = libc.syscall(int(nr), 0, 0, 0, 0)
    print(name, os.strerror(ctypes.get_errno()) if r == -1 else "allowed")
"""


def test_seccomp_denies_kernel_surface_the_namespaces_alone_would_let_through(sandbox_support, monkeypatch):
    """ptrace, keyctl, bpf, io_uring and perf_event_open fail with EPERM under the filter; without
    it (withheld here) they reach the kernel and fail otherwise or succeed: the filter stops them."""
    if not probe().seccomp:
        pytest.skip(f"no seccomp filter on this host: {probe().notes}")
    from k3.envs.syscall_filter import _library
    seccomp = _library()
    names = ("ptrace", "keyctl", "bpf", "io_uring_setup", "perf_event_open")
    argv = ["/usr/bin/python3", "-c", SYSCALLS]
    argv += [str(x) for n in names for x in (n, seccomp.resolve_syscall(seccomp.system_arch(), n))]
    with Sandbox() as sandbox:
        assert "Seccomp:\t2" in sandbox.exec("cat /proc/self/status").text  # filter mode
        assert sandbox.exec(argv).text.splitlines() == [f"{n} Operation not permitted" for n in names]
    real = probe()
    monkeypatch.setattr(sandbox_module, "probe", lambda: dataclasses.replace(real, seccomp=b""))
    with Sandbox() as sandbox:
        assert "Seccomp:\t0" in sandbox.exec("cat /proc/self/status").text
        unfiltered = dict(line.split(" ", 1) for line in sandbox.exec(argv).text.splitlines())
        assert unfiltered["ptrace"] == "allowed" and unfiltered["keyctl"] != "Operation not permitted"


def test_cpu_time_limit(make_sandbox):
    result = make_sandbox(cpu_time_s=0.5).exec("while :; do :; done", timeout=20)
    assert result.killed_reason == "cpu_time" and not result.timed_out
    assert result.wall_s < 3


def test_memory_limit(make_sandbox):
    sandbox = make_sandbox(memory_bytes=64 << 20)
    result = sandbox.exec(["/usr/bin/python3", "-c", "x = bytearray(512 << 20); x[::4096] = b'1' * len(x[::4096])"])
    assert result.killed_reason == "memory" and result.code != 0, result
    assert sandbox.exec("echo alive").text == "alive\n"


def test_fork_bomb_is_stopped_and_harms_no_one(make_sandbox):
    bomb, bystander = make_sandbox(processes=32, cpu_time_s=5), make_sandbox()
    start = time.monotonic()
    result = bomb.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout=10)
    assert result.killed_reason == "pids" and time.monotonic() - start < 3, result
    assert bomb.exec("echo still here").text == "still here\n"  # the bomb's processes are all gone
    assert bystander.exec("echo fine").text == "fine\n"
    if bomb._cgroup is not None:  # no process of the bomb's is left anywhere in its sandbox
        assert bomb._cgroup.procs() == []


def test_huge_write_is_stopped_by_the_file_size_limit(make_sandbox):
    sandbox = make_sandbox(file_size_bytes=16 << 20)
    result = sandbox.exec("head -c 10G /dev/zero > big", timeout=20)
    assert result.killed_reason == "file_size" and result.wall_s < 3, result
    assert sandbox.disk_bytes() <= (16 << 20) + (1 << 20)


def test_many_files_are_stopped_by_the_disk_budget(make_sandbox):
    sandbox = make_sandbox(file_size_bytes=8 << 20, disk_bytes=24 << 20)
    result = sandbox.exec("i=0; while :; do i=$((i+1)); head -c 4M /dev/zero > f$i || exit 1; done", timeout=20)
    assert result.killed_reason == "disk" and result.wall_s < 5, result
    assert sandbox.disk_bytes() < 200 << 20  # bounded overshoot: one poll interval of writes


def test_without_cgroups_rlimits_still_bound_the_sandbox(sandbox_support, monkeypatch):
    """The fallback for hosts without writable cgroups, with this host's cgroups withheld."""
    real = probe()
    monkeypatch.setattr(sandbox_module, "probe", lambda: HostSupport(real.bwrap, {}, ("cgroups withheld",), real.seccomp))
    with Sandbox(Limits(processes=16, cpu_time_s=0.5, file_size_bytes=8 << 20)) as sandbox:
        assert sandbox._cgroup is None and sandbox.notes == ("cgroups withheld",)
        assert all(sandbox.exec("true").ok for _ in range(20))  # no exited exec still counts against NPROC
        assert sandbox.exec("head -c 1G /dev/zero > big").killed_reason == "file_size"
        spin = sandbox.exec("while :; do :; done", timeout=10)
        assert spin.killed_reason == "cpu_time" and spin.wall_s < 9  # 2 s of CPU (the hard limit): slow under load
        bomb = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 1", timeout=5)
        assert b"fork" in bomb.stderr.lower() and bomb.wall_s < 5  # forks past RLIMIT_NPROC are refused
        assert sandbox.exec("echo ok").text == "ok\n"
