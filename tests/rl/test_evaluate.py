"""`python -m k3.rl.evaluate`: a run's greedy held-out figures per effort and kind, equal to the
episodes the trainers evaluate; bad input refused in one line."""
from __future__ import annotations

import json

import pytest

from k3.rl.effort import episode_length
from k3.rl.evaluate import evaluate, load_run, main
from k3.tasks.domains import make_domain
from k3.tasks.episodes import run_episodes
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import trained_tiny_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_tiny_run(tmp_path_factory.mktemp("evaluate"))


def test_figures_are_the_trainers_episodes_counted_by_kind(run):
    model, xtml = load_run(run)
    tasks = make_domain("strings").heldout(6)
    r = evaluate(model, xtml, tasks, "max", max_tokens=8)
    episodes = run_episodes(model, xtml, tasks, "max", 8, measure=episode_length(xtml))
    assert r["episodes"] == 6
    assert r["accuracy"] == sum(e.score.correct for e in episodes) / 6
    assert r["mean_length"] == sum(e.length for e in episodes) / 6
    assert sum(n for _, n in r["kinds"].values()) == 6
    assert set(r["kinds"]) == {t.kind for t in tasks} <= {"reverse", "sort", "count", "nth"}
    assert make_domain("strings").heldout(4) == tasks[:4]  # a run's own set is a prefix of a larger one
    assert {t.kind for t in make_domain("arithmetic").heldout(8)} <= {"1-step", "2-step", "3-step"}


def test_cli_writes_a_line_per_run_and_effort(run, tmp_path, capsys):
    out = tmp_path / "eval.jsonl"
    assert main([str(run), "--domain", "arithmetic", "--efforts", "max,low", "--heldout", "3",
                 "--max-tokens", "4", "--threads", "1", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["effort"] for r in rows] == ["max", "low"] and all(r["episodes"] == 3 for r in rows)
    assert capsys.readouterr().out.count("% of 3") == 2


@pytest.mark.parametrize("args, says", [
    (["--domain", "strings", "NOPE"], "not a run folder with checkpoints: NOPE"),
    (["RUN", "--domain", "strings", "--efforts", "medium"], "effort"),
    (["RUN", "--domain", "strings", "--heldout", "0"], "--heldout and --max-tokens must be >= 1"),
])
def test_bad_input_is_one_line(run, capsys, args, says):
    assert main([str(run) if a == "RUN" else a for a in args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
