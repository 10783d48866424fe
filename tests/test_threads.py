"""k3/threads.py: the thread count from the CPUs available, its overrides, the OpenMP wait policy,
and that `k3` sets them before torch loads."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from k3.threads import LoadAdapter, ThreadChoice, ThreadsError, cgroup_cpu_limit, choose
from tests.helpers.train import REPO

SPIN = "GOMP_SPINCOUNT=300000"
PASSIVE = "OMP_WAIT_POLICY=PASSIVE"


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "K3_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCAL_WORLD_SIZE",
                                  "K3_CHOSE_OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID")}
    return {**env, **extra}


@pytest.mark.parametrize("cli, env, expected", [
    (None, {}, ThreadChoice(8, 8, "auto", SPIN, adapts=True)),
    (None, {"LOCAL_WORLD_SIZE": "4"}, ThreadChoice(2, 8, "auto", SPIN)),
    (None, {"LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1"},
     ThreadChoice(2, 8, "auto", SPIN)),
    (None, {"OMP_NUM_THREADS": "3"}, ThreadChoice(3, 8, "OMP_NUM_THREADS", SPIN)),
    (None, {"OMP_NUM_THREADS": "4,2"}, ThreadChoice(4, 8, "OMP_NUM_THREADS", SPIN)),
    (None, {"OMP_NUM_THREADS": "3", "K3_NUM_THREADS": "5"}, ThreadChoice(5, 8, "K3_NUM_THREADS", SPIN)),
    ("1", {"OMP_NUM_THREADS": "3", "K3_NUM_THREADS": "5"}, ThreadChoice(1, 8, "--threads", SPIN)),
    (None, {"OMP_WAIT_POLICY": "passive"}, ThreadChoice(8, 8, "auto", "OMP_WAIT_POLICY=passive", adapts=True)),
    (None, {"GOMP_SPINCOUNT": "1000"}, ThreadChoice(8, 8, "auto", "GOMP_SPINCOUNT=1000", adapts=True)),
    (None, {"OMP_NUM_THREADS": "3", "K3_CHOSE_OMP_NUM_THREADS": "3"}, ThreadChoice(8, 8, "auto", SPIN, adapts=True)),
], ids=["auto", "torchrun-4-ranks", "torchrun-placeholder-omp", "omp", "omp-nested", "k3-over-omp", "cli-over-all", "user-wait", "user-spin",
        "k3-wrote-omp"])
def test_choice_and_precedence(cli, env, expected):
    assert choose(cli, env, cpus=8) == expected


def test_auto_takes_every_cpu_and_adapts_only_with_more_than_one():
    assert choose(None, {}, cpus=1) == ThreadChoice(1, 1, "auto", SPIN)
    assert choose(None, {}, cpus=2) == ThreadChoice(2, 2, "auto", SPIN, adapts=True)
    assert choose(None, {}, cpus=2, serving=True) == ThreadChoice(1, 2, "auto", SPIN)  # the event loop's CPU
    assert choose(None, {}, cpus=8, serving=True) == ThreadChoice(7, 8, "auto", SPIN, adapts=True)


def test_load_adapter_leaves_other_processes_their_share():
    """others = busy CPU seconds of the machine's (affinity) CPUs less this process's, per second."""
    clock, samples = [0.0], []
    adapter = LoadAdapter(2, clock=lambda: clock[0], read=lambda cpus: samples.pop(0))
    adapter.cpus = {0, 1}
    def tick(dt, machine, ours):
        clock[0] += dt
        samples.append((machine, ours))
        return adapter.poll()
    assert tick(0, 0.0, 0.0) == 2  # the first sample only starts the window
    clock[0] += 0.2
    assert adapter.poll() == 2  # before ADAPT_EVERY_S: no reading (the read would fail: nothing queued)
    assert tick(0.4, 1.25, 1.0) == 2  # 0.25 CPU-s of others in 0.6 s: quiet
    assert tick(1.0, 3.1, 2.0) == 1  # another process took 1 CPU
    assert tick(1.0, 4.7, 3.0) == 1  # still busy (0.7 of a CPU)
    assert tick(1.0, 6.9, 5.0) == 2  # it left
    samples.append(None)
    clock[0] += 1
    assert adapter.poll() == 2  # no /proc: keep the count


@pytest.mark.parametrize("cli, env, name", [
    ("0", {}, "--threads"), ("two", {}, "--threads"), (None, {"K3_NUM_THREADS": "-1"}, "K3_NUM_THREADS"),
    (None, {"OMP_NUM_THREADS": "x"}, "OMP_NUM_THREADS"),
])
def test_bad_counts_are_named(cli, env, name):
    with pytest.raises(ThreadsError, match=f"{name} must be a positive integer"):
        choose(cli, env, cpus=2)


def test_describe_is_one_line():
    assert ThreadChoice(2, 2, "auto", PASSIVE).describe() == "k3: 2 threads (2 CPUs available; OMP_WAIT_POLICY=PASSIVE)"
    assert ThreadChoice(1, 4, "--threads", PASSIVE).describe() == (
        "k3: 1 thread (from --threads; 4 CPUs available; OMP_WAIT_POLICY=PASSIVE)")


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    root = tmp_path / "cg"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("150000 100000\n")
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert cgroup_cpu_limit(root, proc) == 1.5
    proc.write_text("0::/\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cg"
    (root / "cpu,cpuacct").mkdir(parents=True)
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpu,cpuacct:/\n0::/\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_k3_does_not_import_torch():
    code = "import sys, k3, k3.cli, k3.threads; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_configure_reaches_torch_and_openmp():
    code = ("import os, json; from k3.threads import configure; c = configure(None); import torch; "
            "print(json.dumps([torch.get_num_threads(), os.environ['GOMP_SPINCOUNT'], c.source]))")
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=_clean_env(K3_NUM_THREADS="1"))
    assert json.loads(out.stdout) == [1, "300000", "K3_NUM_THREADS"], out.stderr


def test_cli_prints_the_choice_once_and_takes_threads_anywhere():
    cmd = [sys.executable, "-m", "k3", "params", "--config", "k3-tiny", "--json", "--threads", "1"]
    out = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=120, env=_clean_env())
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"k3: 1 thread \(from --threads; \d+ CPUs? available; "
                                            r"GOMP_SPINCOUNT=300000\)", lines[0]), out.stderr
    assert json.loads(out.stdout)["total"] > 0  # stdout stays machine-readable
    bad = subprocess.run([sys.executable, "-m", "k3", "--threads", "0", "params"], check=False, cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=_clean_env())
    assert bad.returncode == 2
    assert bad.stderr.strip() == "k3 params: error: --threads must be a positive integer, got '0'"


def test_version(capsys):
    from k3 import __version__
    from k3.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"k3 {__version__}"
