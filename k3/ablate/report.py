"""A study's results: results.json (everything), results.md (the table), curves.png (seed bands).

Scores are compared with the baseline seed by seed (the same seed means the same initialization
stream and the same data order), so a difference is read against the spread of the paired
differences, not against the spread of each variant alone. A difference "exceeds the seed spread"
when every seed agrees in sign and |mean| > 2 x the std of the paired differences (>= 2 seeds).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from k3.ablate.runner import StudyPlan, load_measures, run_dir
from k3.atomic import write_text_atomic
from k3.train.metrics import MetricsLog

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
CURVES_PNG = "curves.png"


def _stats(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values), "values": values}


def _paired(base: dict[int, float], other: dict[int, float]) -> dict | None:
    seeds = sorted(set(base) & set(other))
    diffs = [other[s] - base[s] for s in seeds]
    st = _stats(diffs)
    if st is None:
        return None
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    st["exceeds_spread"] = st["n"] >= 2 and same_sign and abs(st["mean"]) > 2 * st["std"]
    return st


def collect(sp: StudyPlan, root: Path) -> dict:
    """The study's results as one JSON-able dict (runs not done yet are left out)."""
    variants = []
    for p in sp.variants:
        runs = []
        for planned, seed, job in sp.main_jobs(root):
            if planned is not p or job is None:
                continue
            m = load_measures(root, job)
            if m is not None:
                runs.append({"seed": seed, "run_dir": str(run_dir(root, job).relative_to(root)), "measures": m})
        sweep = {f"{lr:g}": (load_measures(root, job) or {}).get("val_bpb")
                 for q, lr, job in sp.sweep_jobs(root) if q is p}
        changed = {k: v for k, v in p.overrides.items() if sp.scale.overrides.get(k, "absent") != v}
        figures = {key: _stats([r["measures"].get(key) for r in runs]) for key, _ in sp.study.figures}
        variants.append({
            "name": p.variant.name, "what": p.variant.what, "overrides": changed, "train": p.variant.train,
            "params": p.params, "mismatch": p.mismatch, "matched": p.matched, "metric": p.variant.metric,
            "lr_sweep": sweep or None, "runs": runs,
            "score": _stats([r["measures"][p.variant.metric] for r in runs]), "figures": figures})
    base = {r["seed"]: r["measures"][variants[0]["metric"]] for r in variants[0]["runs"]}
    for v in variants[1:]:
        v["delta"] = _paired(base, {r["seed"]: r["measures"][v["metric"]] for r in v["runs"]})
    s = sp.scale
    return {"study": sp.study.name, "title": sp.study.title, "question": sp.study.question,
            "matching": sp.study.matching, "figures": [list(f) for f in sp.study.figures],
            "scale": {"name": s.name, "config": s.config, "overrides": s.overrides, "steps": s.steps,
                      "batch_size": s.batch_size, "seq_len": s.seq_len, "tokens": s.tokens, "device": s.device,
                      "lr": s.lr, "lr_grid": list(s.lr_grid), "eval_windows": s.eval_windows},
            "seeds": sp.seeds, "data": sp.data or "bundled Shakespeare",
            "compute_s": sum(r["measures"]["elapsed"] for v in variants for r in v["runs"]),
            "variants": variants}


def _pm(st: dict | None, digits: int = 4) -> str:
    if st is None:
        return "pending"
    return f"{st['mean']:.{digits}f} ± {st['std']:.{digits}f} (n={st['n']})"


def _figure(st: dict | None) -> str:
    if st is None:
        return "–"
    digits = 4 if abs(st["mean"]) < 10 else 1
    return f"{st['mean']:.{digits}g}" if st["std"] == 0 else f"{st['mean']:.{digits}g} ± {st['std']:.2g}"


def markdown(res: dict) -> str:
    sc = res["scale"]
    setup = (f"Scale `{sc['name']}`: {sc['config']} "
             f"({'; '.join(f'{k}={v}' for k, v in sc['overrides'].items()) or 'as preset'}), "
             f"{sc['steps']} steps x {sc['batch_size']} x {sc['seq_len']} tokens = {sc['tokens']:,} tokens per run, "
             f"seeds {', '.join(map(str, res['seeds']))}, {res['data']}, device {sc['device']}; "
             f"{res['compute_s'] / 60:.1f} min of training and measuring in the finished runs.")
    legend = ("Score: final held-out bits per byte (lower is better); Δ: variant minus baseline, paired by seed, "
              "mean ± std; **bold**: the difference exceeds the seed spread (all seeds agree in sign and "
              "|mean| > 2 std).")
    lines = [f"# {res['title']}", "", res["question"], "", setup, "", f"Matching: {res['matching']}.", "", legend, ""]
    fig_titles = [t for _, t in res["figures"]]
    head = ["variant", "what", "params (total / active)", "val bpb", "Δ vs baseline", *fig_titles]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, v in enumerate(res["variants"]):
        what = v["what"] + (f" [{', '.join(f'{k}={json.dumps(x)}' for k, x in v['overrides'].items() if k not in ('kda_layers', 'full_attn_layers'))}]"
                            if any(k not in ("kda_layers", "full_attn_layers") for k in v["overrides"]) else "")
        mm = v["mismatch"]
        params = (f"{v['params']['total'] / 1e6:.3f}M / {v['params']['active'] / 1e6:.3f}M"
                  + ("" if i == 0 else f" ({mm['total'] * 100:+.1f}% / {mm['active'] * 100:+.1f}%)"))
        score = _pm(v["score"]) + ("" if v["metric"] == "val_bpb" else f" [{v['metric']}]")
        d = v.get("delta")
        delta = "baseline" if i == 0 else ("–" if d is None else (
            f"**{d['mean']:+.4f} ± {d['std']:.4f}**" if d["exceeds_spread"] else f"{d['mean']:+.4f} ± {d['std']:.4f}"))
        figs = [_figure(v["figures"].get(key)) for key, _ in res["figures"]]
        lines.append("| " + " | ".join([f"`{v['name']}`", what, params, score, delta, *figs]) + " |")
    sweeps = [v for v in res["variants"] if v["lr_sweep"]]
    if sweeps:
        grid = sorted({lr for v in sweeps for lr in v["lr_sweep"]}, key=float)
        lines += ["", (f"Learning-rate sweep (seed {res['seeds'][0]}, final val bpb; the lowest is used for every seed; "
                       "a grid is extended past an edge while its best rate sits there):"), "",
                  "| variant | " + " | ".join(f"lr {lr}" for lr in grid) + " |", "|---|" + "---|" * len(grid)]
        for v in sweeps:
            cells = ["–" if lr not in v["lr_sweep"] else "pending" if v["lr_sweep"][lr] is None
                     else f"{v['lr_sweep'][lr]:.4f}" for lr in grid]
            lines.append(f"| `{v['name']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(sp: StudyPlan, root: Path, res: dict, path: Path) -> None:
    """Validation curves (mean over seeds, band = min..max) and the study's training-record curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = sp.study.curve
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(12 if curve else 7, 4.5), squeeze=False)
    for v in res["variants"]:
        evals, trains = [], []
        for r in v["runs"]:
            records = MetricsLog(root / r["run_dir"]).read()
            evals.append({x["step"]: x["val_bpb"] for x in records if x["kind"] == "eval"})
            if curve:
                trains.append({x["step"]: x[curve[0]] for x in records if x["kind"] == "train" and curve[0] in x})
        _band(axes[0][0], evals, v["name"])
        if curve:
            _band(axes[0][1], trains, v["name"], smooth=max(1, res["scale"]["steps"] // 20))
    axes[0][0].set(xlabel="step", ylabel="val bits per byte", title=f"{res['study']}: held-out bpb (band: seeds' range)")
    if curve:
        axes[0][1].set(xlabel="step", ylabel=curve[1], title=f"{curve[1]} (moving average, band: seeds' range)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _band(ax, runs: list[dict[int, float]], label: str, smooth: int = 1) -> None:
    steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
    if not steps:
        return
    series = []
    for r in runs:
        ys = [r[s] for s in steps]
        series.append([statistics.fmean(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))])
    mean = [statistics.fmean(col) for col in zip(*series)]
    line, = ax.plot(steps, mean, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
    if len(runs) > 1:
        ax.fill_between(steps, [min(c) for c in zip(*series)], [max(c) for c in zip(*series)],
                        color=line.get_color(), alpha=0.2)


def write(sp: StudyPlan, root: Path) -> Path:
    """Write the study's folder under `root`; returns it."""
    folder = root / sp.study.name
    folder.mkdir(parents=True, exist_ok=True)
    res = collect(sp, root)
    write_text_atomic(folder / RESULTS_JSON, json.dumps(res, indent=1) + "\n")
    write_text_atomic(folder / RESULTS_MD, markdown(res))
    plot(sp, root, res, folder / CURVES_PNG)
    return folder
