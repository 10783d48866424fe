"""The seccomp filter every sandboxed command runs under: the system calls that reach kernel surface
an agent's shell work never needs (namespaces and mounts, tracing, kernel modules and kexec, BPF,
keyrings, io_uring, userfaultfd) fail with EPERM; everything else is allowed.

The BPF program is built once by libseccomp (through `pyseccomp`, its ctypes bindings, or the
official `seccomp` bindings where installed) and handed to bwrap as `--seccomp FD`, which loads it
just before it execs the command: bwrap's own setup (mounts, pivot_root) runs unfiltered. System
calls of another ABI than the native one (x86-64's i386 or x32 entry points) kill the process, so the
list cannot be bypassed through them. The filter comes on top of what already isolates (namespaces,
no capabilities, an unprivileged uid, no new privileges): most of these calls would fail for lack of
a capability anyway, but the filter stops them before the kernel code behind them runs.
"""
from __future__ import annotations

import errno
import functools
import os

DENIED = (
    # namespaces, mounts and root changes
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr",
    # another process's memory, performance counters
    "ptrace", "process_vm_readv", "process_vm_writev", "perf_event_open",
    # the kernel itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf", "reboot", "swapon",
    "swapoff", "acct", "syslog", "quotactl", "iopl", "ioperm",
    # keyrings, and interfaces with a long record of kernel bugs
    "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at",
)


def _library():
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError):  # not installed, or libseccomp.so missing
        import seccomp  # libseccomp's own bindings (Debian python3-seccomp); ImportError if absent too
    return seccomp


@functools.cache
def filter_program() -> tuple[bytes, str]:
    """(the BPF program, "") or (b"", why there is none): built once per process."""
    try:
        seccomp = _library()
    except (ImportError, RuntimeError) as e:
        return b"", f"no seccomp filter: libseccomp's Python bindings are unavailable ({e})"
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    arch = seccomp.system_arch()
    for name in DENIED:
        try:
            if seccomp.resolve_syscall(arch, name) < 0:
                continue  # not a system call of this architecture (iopl off x86)
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError, RuntimeError):
            continue  # a libseccomp older than the call: nothing to deny by that name
    fd = os.memfd_create("k3-envs-seccomp")
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            rules.export_bpf(f)
        return os.pread(fd, 1 << 20, 0), ""
    finally:
        os.close(fd)


def program_fd(program: bytes) -> int:
    """A fresh file descriptor holding `program` from its start (bwrap reads it to the end, so each
    exec needs its own); the caller passes it to bwrap and closes it."""
    fd = os.memfd_create("k3-envs-seccomp", 0)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
