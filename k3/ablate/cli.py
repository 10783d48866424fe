"""`k3 ablate`: train a study's baseline and variants over several seeds and write its results.

    k3 ablate --study mixer                 # CPU scale, 3 seeds: results in runs/ablate-cpu/mixer/
    k3 ablate --study all --quick           # a smoke run of every study (seconds each)
    k3 ablate --study residual --scale gpu  # k3-1b-sized, on CUDA

Rerunning the same command resumes: finished runs are kept, an interrupted one continues from its
latest checkpoint. Studies, scales and matching: k3/ablate/studies.py; docs/ABLATIONS.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from k3.ablate.studies import SCALES, STUDIES, AblateError, get_scale, get_study

REPORT_EVERY_S = 60  # while runs finish, a study's table and plots are rewritten at most this often


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help=f"a study ({', '.join(STUDIES)}), several joined by commas (run in that order), "
                                   "or all (required unless --list)")
    p.add_argument("--list", action="store_true", help="list the studies, their variants and matching, then exit")
    p.add_argument("--scale", default="cpu", help=f"{' | '.join(SCALES)} (default cpu)")
    p.add_argument("--quick", action="store_true", help="a smoke run: a few steps (a smaller model on CPU), 2 seeds")
    p.add_argument("--seeds", type=int, help="seeds per variant (default: the scale's, 3 on CPU)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: the scale's); a shorter budget")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs in parallel worker processes (default 1; on CUDA, one per GPU)")
    p.add_argument("--out", help="ablation folder (default runs/ablate-<scale>); reused runs are shared by studies")
    p.add_argument("--data", help="training corpus as in k3 train (default: the bundled Shakespeare)")
    p.add_argument("--cache-dir", help="tokenizer/token cache (default $K3_CACHE_DIR or ~/.cache/k3)")
    p.add_argument("--device", help="override the scale's device (cpu, cuda)")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="write no checkpoints (an interrupted run starts over): for a machine whose disk does not "
                        "outlive the session")
    p.add_argument("--report-only", action="store_true", help="rewrite the tables and plots from finished runs")
    p.add_argument("--no-progress", action="store_true", help="no per-step progress lines")


def _list() -> int:
    from k3.ablate.studies import plan

    scale = get_scale("cpu")
    for study in STUDIES.values():
        print(f"{study.name}: {study.title}\n  matching: {study.matching}")
        for p in plan(study, scale):
            print(f"  - {p.variant.name}: {p.variant.what} ({p.params['total'] / 1e6:.3f}M / "
                  f"{p.params['active'] / 1e6:.3f}M at the cpu scale)")
    return 0


def run(args) -> int:
    try:
        if args.list:
            return _list()
        if not args.study:
            raise AblateError("say which study: --study NAME (or all); --list shows them")
        names = list(STUDIES) if args.study == "all" else args.study.split(",")
        studies = [get_study(name) for name in dict.fromkeys(names)]  # in the order given
        scale = get_scale(args.scale, args.quick)
        if args.device:
            scale = dataclasses.replace(scale, device=args.device)
        if args.steps:
            scale = dataclasses.replace(scale, name=f"{scale.name}-{args.steps}steps", steps=args.steps,
                                        ckpt_every=min(args.steps, scale.ckpt_every or scale.eval_every))
        seeds = args.seeds or scale.seeds
        if seeds < 1 or args.jobs < 1 or (args.steps is not None and args.steps < 1):
            raise AblateError("--seeds, --steps and --jobs must be >= 1")
    except AblateError as e:
        print(f"k3 ablate: error: {e}", file=sys.stderr)
        return 2
    return ablate(studies, scale, list(range(seeds)), Path(args.out or f"runs/ablate-{scale.name}"), jobs=args.jobs,
                  data=args.data, cache_dir=args.cache_dir, report_only=args.report_only,
                  progress=not args.no_progress, checkpoints=not args.no_checkpoints)


def ablate(studies, scale, seeds: list[int], root: Path, *, jobs: int = 1, data: str | None = None,
           cache_dir: str | None = None, report_only: bool = False, progress: bool = True, checkpoints: bool = True,
           log=print) -> int:
    from k3.ablate import report
    from k3.ablate.runner import adopt_runs, make_plans, run_all
    from k3.data.corpus import DataError
    from k3.train.errors import TrainError

    try:
        plans = make_plans(studies, scale, seeds, data, cache_dir)
    except (AblateError, TrainError) as e:
        print(f"k3 ablate: error: {e}", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    adopt_runs(root)
    (root / "plan.json").write_text(json.dumps({"studies": [s.name for s in studies], "scale": scale.name,
                                                "seeds": seeds, "data": data}, indent=1) + "\n")

    written: dict[str, float] = {}

    def write_reports(job=None) -> None:
        """Every study's report; after a run (`job`), those it serves, at most one a minute each."""
        for sp in plans:
            if job is not None and (time.perf_counter() - written.get(sp.study.name, -REPORT_EVERY_S) < REPORT_EVERY_S
                                    or not any(j is not None and j.run_id == job.run_id for j in sp.all_jobs(root))):
                continue
            report.write(sp, root)
            written[sp.study.name] = time.perf_counter()
    t0 = time.perf_counter()
    if not report_only:
        log(f"k3 ablate: {', '.join(s.name for s in studies)} at scale {scale.name} ({scale.config}, "
            f"{scale.tokens:,} tokens a run), seeds {seeds}, in {root}")
        try:
            trained = run_all(plans, root, jobs=jobs, on_done=write_reports, log=log, progress=progress,
                              checkpoints=checkpoints)
        except (TrainError, DataError) as e:
            print(f"k3 ablate: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ninterrupted; rerun the same command to continue", file=sys.stderr)
            return 130
        log(f"trained {trained} runs in {(time.perf_counter() - t0) / 60:.1f} min")
    write_reports()
    for sp in plans:
        log(f"{sp.study.name}: {root / sp.study.name / report.RESULTS_MD}")
    return 0
