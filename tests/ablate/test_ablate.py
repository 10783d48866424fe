"""`k3 ablate`: every built-in study's smoke run writes a table and plots that parse (four studies
in the default run, the rest under `-m slow`); the budgets a study claims to match are matched; the
optimizer switch; resuming reuses finished runs."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from k3.ablate import report
from k3.ablate.cli import ablate
from k3.ablate.runner import adopt_runs, make_plans, pending, run_id
from k3.ablate.studies import MATCH_TOL, SCALES, STUDIES, AblateError, get_scale, get_study, plan
from k3.cli import main
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.train.muon import param_groups
from tests.helpers.train import quiet, small_corpus

# The default run smoke-runs these studies; between them they take every path of the runner and the
# report (parameters matched through one knob and through two, an lr sweep, extra figures and a
# curve panel, two seeds and their paired differences). The others' runs only change the config
# (their model variants are tested in tests/model and tests/train) and run under `-m slow`.
DEFAULT_STUDIES = ("mixer", "ffn", "optimizer", "precision")


@pytest.fixture(scope="module")
def quick_root(tmp_path_factory):
    """A study's --quick run on seed 0 into one folder, on first use (studies share their baseline
    runs), the precision study also on a second seed (seed bands, paired differences); -> (folder,
    data, run: name -> folder, done: the studies run so far)."""
    root = tmp_path_factory.mktemp("ablate")
    data = small_corpus(root)
    common = {"data": data, "cache_dir": str(root / "cache"), "progress": False, "log": quiet}
    done: list[str] = []

    def run(name: str):
        if name not in done:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # a micro model's ops are far too small to share between threads
            try:
                seeds = [0, 1] if name == "precision" else [0]
                assert ablate([get_study(name)], get_scale("cpu", quick=True), seeds, root / "out", **common) == 0
            finally:
                torch.set_num_threads(threads)
            done.append(name)
        return root / "out"
    return root / "out", data, run, done


def _table(md: str) -> list[str]:
    """The results table's lines: header, rule and one row per variant."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


@pytest.mark.parametrize("name", [n if n in DEFAULT_STUDIES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in STUDIES])
def test_quick_study_writes_table_and_plots(quick_root, name):
    _root, _, run, _ = quick_root
    folder = run(name) / name
    res = json.loads((folder / report.RESULTS_JSON).read_text())
    seeds = 2 if name == "precision" else 1
    assert res["study"] == name and len(res["seeds"]) == seeds
    for v in res["variants"]:
        assert v["score"]["n"] == seeds and v["score"]["mean"] > 0, v["name"]
        assert {r["measures"]["tokens"] for r in v["runs"]} == {res["scale"]["tokens"]}  # the same budget
        assert set(v["figures"]) == {key for key, _ in STUDIES[name].figures}
    table = _table((folder / report.RESULTS_MD).read_text())
    assert len(table) == 2 + len(res["variants"])
    assert len({line.count("|") for line in table}) == 1  # no cell breaks the table
    png = (folder / report.CURVES_PNG).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    if name == "precision":
        delta = res["variants"][1]["delta"]
        assert delta["n"] == 2 and len(delta["values"]) == 2


def test_rerun_trains_nothing(quick_root):
    root, data, run, done = quick_root
    for name in DEFAULT_STUDIES:
        run(name)
    plans = make_plans([get_study(name) for name in done], get_scale("cpu", quick=True), [0], data, None)
    assert pending(plans, root) == []


def test_paired_differences_and_spread():
    same_sign = report._paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.9, 1: 1.91, 2: 2.89})
    assert same_sign["mean"] == pytest.approx(-0.1, abs=1e-9) and same_sign["exceeds_spread"]
    mixed = report._paired({0: 1.0, 1: 2.0}, {0: 1.1, 1: 1.95})
    assert not mixed["exceeds_spread"]
    assert report._paired({0: 1.0}, {1: 1.0}) is None  # no seed in common


# k3-1b counts take ~10 s; the id avoids "gpu", a keyword conftest skips without CUDA
@pytest.mark.parametrize("scale", ["cpu", pytest.param("gpu", marks=pytest.mark.slow, id="gpu-scale")])
def test_claimed_matches_hold(scale):
    """Every variant of every study is within 2% of its baseline's total and active parameters, and
    trains on the same tokens (steps x batch x length)."""
    sc = SCALES[scale]
    for study in STUDIES.values():
        for p in plan(study, sc):
            assert all(abs(m) <= MATCH_TOL for m in p.mismatch.values()), (study.name, p.variant.name, p.mismatch)
            s = sc.settings(0, **p.variant.train)
            assert s.steps * s.batch_size * s.seq_len == sc.tokens


def test_errors_are_one_line(capsys):
    with pytest.raises(AblateError, match="unknown study 'nope'"):
        get_study("nope")
    with pytest.raises(SystemExit) as e:
        main(["ablate", "--study", "nope", "--quick"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"k3 ablate: error: unknown study 'nope'; choose from {', '.join(STUDIES)} or all"


@pytest.mark.parametrize("optimizer", ["per-head-muon", "muon", "adamw"])
def test_optimizer_switch_groups(optimizer):
    cfg = load_config("k3-tiny").replace(num_hidden_layers=4, kda_layers=[], full_attn_layers=[])
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    groups = param_groups(model, cfg, weight_decay=0.1, optimizer=optimizer)
    names = {g["name"] for g in groups}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    if optimizer == "adamw":
        assert names == {"adamw_decay", "adamw_no_decay"}
    elif optimizer == "muon":
        assert "muon_whole" in names and not any(n.startswith(("muon_rows", "muon_cols")) for n in names)
    else:
        assert any(n.startswith("muon_rows") for n in names)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        param_groups(model, cfg, weight_decay=0.1, optimizer="sgd")


def test_run_id_ignores_settings_at_their_default(tmp_path):
    """A run folder keeps its name when TrainSettings gains a field whose default keeps old behaviour
    (an old run.json lacks it), and a folder named under another rule is renamed to its id."""
    s = dataclasses.asdict(get_scale("cpu").settings(1))
    old = {k: v for k, v in s.items() if k != "grad_accum"}  # as if grad_accum did not exist yet
    assert run_id(old) == run_id(s) != run_id({**s, "grad_accum": 2})
    assert run_id({**s, "device": "cuda:1"}) == run_id({**s, "device": "cuda"})
    # except a default that changed behaviour: a run.json from before weight_init drew the normal init
    before_init = {k: v for k, v in s.items() if k != "weight_init"}
    assert run_id(before_init) == run_id({**s, "weight_init": "normal"}) != run_id(s)
    stale = tmp_path / "runs" / "s1-000000000000"
    stale.mkdir(parents=True)
    (stale / "run.json").write_text(json.dumps(old))
    assert adopt_runs(tmp_path) == 1 and (tmp_path / "runs" / run_id(s) / "run.json").is_file()


def test_lr_sweep_grows_past_an_edge_until_the_best_is_inside(tmp_path):
    """A best rate on the grid's edge is not tuned: the grid doubles past it (bounded), and the
    seeds wait until the sweep is done. The runs' scores are written by hand (no training)."""
    scale = dataclasses.replace(get_scale("cpu", quick=True), lr_grid=(2e-3, 4e-3, 8e-3))
    sp = make_plans([get_study("optimizer")], scale, [0, 1])[0]
    p = sp.variants[0]
    best = 3.2e-2  # the score falls until 3.2e-2, then rises

    def finish(lr):
        d = tmp_path / "runs" / sp.job(p, 0, lr).run_id
        d.mkdir(parents=True, exist_ok=True)
        (d / "measures.json").write_text(json.dumps({"val_bpb": abs(lr - best)}))

    for _ in range(4):  # 3 points, then 3 extensions
        grid, done = sp.sweep_grid(tmp_path, p)
        assert not done and sp.tuned_lr(tmp_path, p) is None
        for lr in grid:
            finish(lr)
    grid, done = sp.sweep_grid(tmp_path, p)
    assert done and grid == pytest.approx([2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2])
    assert sp.tuned_lr(tmp_path, p) == pytest.approx(best)
    assert all(job.settings.lr == pytest.approx(best) for q, _, job in sp.main_jobs(tmp_path) if q is p)
