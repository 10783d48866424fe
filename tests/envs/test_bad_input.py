"""Commands and paths an agent gets wrong or gets malicious: each gives a clear result and leaks
nothing (no process, no unbounded memory, no file outside the sandbox)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from k3.envs import SandboxError
from k3.envs.sandbox import TRUNCATED


def test_a_command_that_never_ends_times_out(make_sandbox):
    sandbox = make_sandbox()
    start = time.monotonic()
    result = sandbox.exec("echo started; sleep 1000", timeout=0.5)
    assert result.timed_out and result.killed_reason == "timeout" and result.text == "started\n"
    assert time.monotonic() - start < 2
    assert sandbox.exec("echo next").text == "next\n"


def test_a_background_job_holding_the_pipes_does_not_hang_exec(make_sandbox):
    result = make_sandbox().exec("sleep 1000 & echo done", timeout=5)
    assert result.ok and result.text == "done\n" and result.wall_s < 2


def test_binary_output_and_input_round_trip(make_sandbox):
    sandbox = make_sandbox()
    data = bytes(range(256)) * 64
    assert sandbox.exec("cat", stdin=data).stdout == data
    sandbox.write_file("bin.dat", data)
    assert sandbox.read_file("bin.dat") == data
    big = bytes(range(256)) * 4096  # 1 MiB through stdin: written without blocking on the reader
    assert sandbox.exec("sha256sum | cut -c1-8", stdin=big).ok


def test_huge_output_is_truncated_with_a_marker(make_sandbox):
    sandbox = make_sandbox(output_bytes=64 << 10)
    result = sandbox.exec("head -c 5M /dev/zero; head -c 100 /dev/zero >&2")
    assert result.ok and result.truncated
    dropped = (5 << 20) - (64 << 10)
    assert result.stdout == bytes(64 << 10) + TRUNCATED % dropped
    assert result.stderr == bytes(100)
    endless = sandbox.exec("yes", timeout=1)  # drained and dropped until the timeout: memory stays bounded
    assert endless.timed_out and len(endless.stdout) < (64 << 10) + 100


def test_dotdot_and_symlinks_stay_inside(make_sandbox, tmp_path):
    sandbox = make_sandbox()
    passwd = sandbox.read_file("../../../../../../etc/passwd").decode()
    assert "agent:x:" in passwd and passwd.count("\n") == 3  # the sandbox's own, not the host's
    sandbox.write_file("../../../../tmp/../etc/planted", "x")
    assert not Path("/etc/planted").exists() and sandbox.read_file("/etc/planted") == b"x"
    (tmp_path / "secret").write_text("host secret")
    for target in (tmp_path / "secret", Path("/root/.bashrc"), Path("/work/main/pyproject.toml")):
        assert sandbox.exec(f"ln -sf {target} link").ok
        with pytest.raises(SandboxError, match="No such file"):
            sandbox.read_file("link")
    with pytest.raises(SandboxError, match="nonexistent"):  # the host's /work is not there to write to
        sandbox.write_file("link", "written through the link")
    outside = Path(f"/tmp/k3-envs-test-{tmp_path.name}")
    sandbox.exec(f"ln -sf {outside} link2")
    sandbox.write_file("link2", "x")  # lands in the sandbox's own /tmp
    assert not outside.exists() and sandbox.read_file(str(outside)) == b"x"
    assert (tmp_path / "secret").read_text() == "host secret"


def test_bad_paths_and_commands_are_refused(make_sandbox):
    sandbox = make_sandbox()
    for path in ("", "a\0b"):
        with pytest.raises(SandboxError, match="bad sandbox path"):
            sandbox.read_file(path)
    with pytest.raises(SandboxError, match="bad command"):
        sandbox.exec(["echo", "a\0b"])
    with pytest.raises(SandboxError, match="No such file"):
        sandbox.read_file("missing.txt")
    with pytest.raises(SandboxError, match="Is a directory"):
        sandbox.read_file("/tmp")
    with pytest.raises(SandboxError, match="larger than"):
        sandbox.exec("head -c 2000 /dev/zero > big") and sandbox.read_file("big", max_bytes=1000)
    assert sandbox.exec(["no-such-program"]).code != 0
