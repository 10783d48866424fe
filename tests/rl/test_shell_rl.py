"""`k3 rl --domain shell` with the sandboxes (k3/tasks/shell.py, k3/envs): under partial rollout an
episode waiting for the model keeps its sandbox paused and resumes it in the same state next
iteration; a run killed mid-way resumes exactly (the sandboxes it lost are replayed); a normal exit,
a crash and Ctrl-C leave no sandbox, cgroup, mount or process behind. The policy is scripted
(tests/helpers/shell_policy.py): the tiny model's own replies would rarely call a tool."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from k3.envs.host import probe
from k3.rl.trainer import RLSettings, RLTrainer
from k3.tasks import shell
from tests.helpers import shell_policy
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import quiet, trained_tiny_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def init_run(tmp_path_factory) -> Path:
    return trained_tiny_run(tmp_path_factory.mktemp("pre"))


@pytest.fixture
def sandbox_root(sandbox_support, monkeypatch) -> Path:
    """Sandboxes of this test under a directory of its own (the sandbox uid may traverse it)."""
    root = Path(tempfile.mkdtemp(prefix="k3-shell-rl-"))
    root.chmod(0o755)
    shell.release()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shell.release()
    monkeypatch.undo()
    assert not list(root.glob("k3-envs-*")), "a sandbox was left behind"
    root.rmdir()


def settings(init: Path, out: Path, **changes) -> RLSettings:
    base = RLSettings(init=str(init), out=str(out), domain="shell", steps=4, prompts=2, samples=2, max_tokens=2,
                      pool=4, heldout=1, budget_samples=1, eval_every=4, ckpt_every=2, stop_fraction=0.5,
                      sandboxes=2)
    return dataclasses.replace(base, **changes)


def records(run: Path) -> list[dict]:
    out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("rollout_s", "elapsed", "tok_per_s")} for r in out
            if r["kind"] == "train"]


class Watch:
    """What the scripted episodes saw: the second probe's results, the replays of lost sandboxes,
    and at each iteration's end how many episodes wait and how many of those are paused."""

    def __init__(self, monkeypatch):
        self.probes, self.replays, self.waiting = [], 0, []
        take, rollout = shell.take_episode, RLTrainer.rollout

        def take_episode(task, calls_so_far):
            with shell._lock:
                kept = bool(shell._live.get(shell.calls_key(task, calls_so_far)))
            self.replays += bool(calls_so_far) and not kept
            return take(task, calls_so_far)

        def watched_rollout(trainer):
            out = rollout(trainer)
            self.waiting.append((shell.live_count(), shell.paused_count()))
            for t in trainer.unfinished:
                if t.tag.get("turn") == 3:
                    self.probes.append(t.tag["messages"][-1]["content"])
            return out

        monkeypatch.setattr(shell, "take_episode", take_episode)
        monkeypatch.setattr(RLTrainer, "rollout", watched_rollout)


def train(s: RLSettings, resume: bool = False, steps: int | None = None) -> RLTrainer:
    trainer = RLTrainer.from_run(s.out, progress=False, log=quiet) if resume else RLTrainer(s, progress=False, log=quiet)
    try:
        if steps is None:
            trainer.train()
        else:
            trainer._record([trainer.train_step() for _ in range(steps)])
            trainer._save()
            trainer.train_step()  # killed during the next step
    finally:
        trainer.close()
    return trainer


@pytest.mark.slow
def test_paused_sandboxes_resume_in_place_and_a_killed_run_resumes_exactly(init_run, tmp_path, sandbox_root,
                                                                           monkeypatch):
    shell_policy.install(monkeypatch.setattr)
    watch = Watch(monkeypatch)
    train(settings(init_run, tmp_path / "a"))
    straight = records(tmp_path / "a")
    assert sum(r["accuracy"] * r["episodes"] for r in straight) > 0  # the scripted policy solves the tasks
    assert any(live for live, _ in watch.waiting)  # episodes waited across an iteration's end ...
    assert all(live == paused for live, paused in watch.waiting)  # ... each with its sandbox paused
    assert watch.probes and set(watch.probes) == {"t1\nt2"} and watch.replays == 0  # resumed in place
    assert shell.live_count() == 0

    watch.probes, watch.replays = [], 0
    train(settings(init_run, tmp_path / "b"), steps=2)
    train(settings(init_run, tmp_path / "b"), resume=True)
    assert records(tmp_path / "b")[2:] == straight[2:]  # bit for bit after the resume
    assert watch.replays > 0 and set(watch.probes) == {"t1\nt2"}  # lost sandboxes replayed to the same state


DRIVER = textwrap.dedent("""\
    import os, sys, tempfile
    from pathlib import Path
    from tests.helpers import shell_policy
    from k3.tasks import shell
    from k3.rl.trainer import RLTrainer

    class Patch:
        def __call__(self, obj, name, value):
            setattr(obj, name, value)

    shell_policy.install(Patch())
    mode = sys.argv[1]
    take = shell.take_episode
    calls = [0]

    def take_episode(task, calls_so_far):
        calls[0] += 1
        if calls[0] == 6:
            print("sandboxes live", flush=True)
            if mode == "crash":
                raise RuntimeError("a crash mid-episode")
            if mode == "sigint":
                import time
                time.sleep(60)  # Ctrl-C arrives while the episodes' sandboxes are out
        return take(task, calls_so_far)

    shell.take_episode = take_episode
    from k3.cli import main
    main(sys.argv[2:])
""")


def _leftovers(root: Path, pid: int) -> list[str]:
    found = [str(p) for p in root.glob("k3-envs-*")]
    found += [str(d) for parent in probe().cgroup_dirs.values() for d in parent.glob(f"k3-envs-{pid}-*")]
    found += [line for line in Path("/proc/mounts").read_text().splitlines() if str(root) in line]
    for p in Path("/proc").iterdir():  # a bwrap left running
        try:
            if p.name.isdigit() and str(root) in (p / "cmdline").read_bytes().decode(errors="replace"):
                found.append(f"process {p.name}")
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["normal", "crash", "sigint"])
def test_no_sandbox_is_left_after_exit_crash_or_ctrl_c(mode, init_run, tmp_path, sandbox_support):
    root = Path(tempfile.mkdtemp(prefix="k3-shell-rl-"))
    root.chmod(0o755)
    argv = ["rl", "--run", str(init_run), "--out", str(tmp_path / "rl"), "--domain", "shell", "--steps", "2",
            "--prompts", "2", "--samples", "2", "--max-tokens", "2", "--pool", "2", "--heldout", "1",
            "--budget-samples", "1", "--eval-every", "2", "--ckpt-every", "2", "--sandboxes", "2", "--no-progress"]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, mode, *argv], cwd=REPO, text=True,
                            env={**os.environ, "TMPDIR": str(root)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if mode == "sigint":
            while (line := proc.stdout.readline()) not in ("sandboxes live\n", ""):
                pass
            assert line == "sandboxes live\n"
            time.sleep(0.2)
            assert list(root.glob("k3-envs-*"))  # the pool is there when Ctrl-C comes
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert (proc.returncode == 0) == (mode == "normal"), err[-2000:]
    if mode == "crash":
        assert "a crash mid-episode" in err
    assert _leftovers(root, proc.pid) == []
    root.rmdir()
