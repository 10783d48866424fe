"""Running an ablation: the jobs of one or more studies, resumable, one process or several.

Layout of an ablation folder (`--out`):
  runs/<id>/          one training run (a `k3 train` run folder) + measures.json once it is done;
                      <id> hashes the run's settings, so a run that two studies share (the same
                      baseline) trains once
  <study>/            results.md, results.json, curves.png (k3/ablate/report.py)
  plan.json           the studies, scale and seeds asked for

Resuming is rerunning the same command: a run with measures.json is done, a run with run.json
continues from its latest checkpoint (`Trainer.from_run`, bit-exact on CPU), anything else starts
over. The optimizer study first sweeps each optimizer's learning rate on the first seed
(`Scale.lr_grid`, doubled or halved past an edge while the best rate sits on it), then runs every
seed at the best one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from k3.ablate.studies import Planned, Scale, Study, plan
from k3.atomic import write_text_atomic
from k3.train.trainer import RUN_FILE, Trainer, TrainSettings, absolute_paths

MEASURES_FILE = "measures.json"
SWEEP_EXTEND = 3  # how far a learning-rate grid may grow past its edges: bounds the search


_DEFAULTS = json.loads(json.dumps(dataclasses.asdict(TrainSettings())))
_NOT_IDENTITY = ("out", "cache_dir")  # where a run is written or its tokens cached changes nothing it computes


def run_id(settings: dict) -> str:
    """`s<seed>-<hash>` of the settings that differ from TrainSettings' defaults: a setting added
    later with a default that keeps old behaviour does not rename finished runs."""
    d = absolute_paths(json.loads(json.dumps(settings)))  # as run.json stores them
    d["device"] = str(d.get("device", "cpu")).split(":")[0]  # cuda:1 trains what cuda:0 trains
    d.setdefault("weight_init", "normal")  # a run.json from before the setting drew K3's normal init
    key = {k: v for k, v in d.items() if k not in _NOT_IDENTITY and (k not in _DEFAULTS or v != _DEFAULTS[k])}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return f"s{d.get('seed', 0)}-{digest}"


@dataclass(frozen=True)
class Job:
    settings: TrainSettings  # without `out`: the folder follows from the settings

    @property
    def run_id(self) -> str:
        return run_id(dataclasses.asdict(self.settings))


def adopt_runs(root: Path) -> int:
    """Rename run folders whose name is not the id of their run.json (named under an older id
    rule); returns how many moved."""
    moved = 0
    for folder in sorted((root / "runs").glob("s*-*")):
        try:
            name = run_id(json.loads((folder / RUN_FILE).read_text()))
        except (OSError, ValueError):
            continue
        if name != folder.name and not (folder.parent / name).exists():
            folder.rename(folder.parent / name)
            moved += 1
    return moved


def run_dir(root: Path, job: Job) -> Path:
    return root / "runs" / job.run_id


def load_measures(root: Path, job: Job) -> dict | None:
    path = run_dir(root, job) / MEASURES_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class _NoCheckpointTrainer(Trainer):
    """Writes no checkpoint: for a leased machine whose disk does not outlive the call, where a
    k3-1b checkpoint with its optimizer state (~17 GB) costs more time than it could save."""

    def _save(self):
        return None


def execute(root: str, settings: TrainSettings, progress: bool = True, log=print, checkpoints: bool = True) -> dict:
    """Train (or finish) one run and measure it; returns its measures. Safe to call again."""
    from k3.ablate.measure import measure

    trainer_class = Trainer if checkpoints else _NoCheckpointTrainer
    job = Job(settings)
    folder = run_dir(Path(root), job)
    done = load_measures(Path(root), job)
    if done is not None:
        return done
    quiet = (lambda *a, **k: None) if not progress else log
    if (folder / RUN_FILE).is_file():
        trainer = trainer_class.from_run(folder, progress=progress, log=quiet)
    else:
        if folder.exists():  # killed before its run file was written: nothing to keep
            shutil.rmtree(folder)
        trainer = trainer_class(dataclasses.replace(settings, out=str(folder)), progress=progress, log=quiet)
    try:
        final = trainer.train()
        measures = measure(trainer, final)
    finally:
        trainer.close()
    write_text_atomic(folder / MEASURES_FILE, json.dumps(measures, indent=1) + "\n")
    return measures


def _execute_quietly(root: str, settings: TrainSettings, checkpoints: bool) -> dict:
    return execute(root, settings, progress=False, checkpoints=checkpoints)


@dataclass
class StudyPlan:
    """A study at a scale: its resolved variants, the jobs of each (variant, seed), the LR sweep."""
    study: Study
    scale: Scale
    variants: list[Planned]
    seeds: list[int]
    data: str | None = None
    cache_dir: str | None = None

    def job(self, planned: Planned, seed: int, lr: float | None = None) -> Job:
        changes = dict(planned.variant.train)
        if lr is not None:
            changes["lr"] = lr
        s = self.scale.settings(seed, **changes)
        return Job(dataclasses.replace(s, overrides=planned.overrides, data=self.data, cache_dir=self.cache_dir))

    def sweep_grid(self, root: Path, planned: Planned) -> tuple[list[float], bool]:
        """The variant's learning rates to try and whether its sweep is done. The grid starts at
        `Scale.lr_grid` and doubles (or halves) past an edge while the best rate sits on that edge,
        up to SWEEP_EXTEND times: a best rate on the grid's edge is not a tuned one."""
        grid = sorted(self.scale.lr_grid)
        for _ in range(SWEEP_EXTEND + 1):
            scores = {lr: load_measures(root, self.job(planned, self.seeds[0], lr)) for lr in grid}
            if any(m is None for m in scores.values()):
                return grid, False
            best = min(grid, key=lambda lr: scores[lr]["val_bpb"])
            if len(grid) < 2 or len(grid) >= len(self.scale.lr_grid) + SWEEP_EXTEND or grid[0] < best < grid[-1]:
                return grid, True
            grid = grid + [grid[-1] * 2] if best == grid[-1] else [grid[0] / 2] + grid
        return grid, True

    def sweep_jobs(self, root: Path) -> list[tuple[Planned, float, Job]]:
        return [(p, lr, self.job(p, self.seeds[0], lr)) for p in self.variants if p.variant.sweep_lr
                for lr in self.sweep_grid(root, p)[0]]

    def tuned_lr(self, root: Path, planned: Planned) -> float | None:
        """The swept variant's best learning rate (lowest final val bpb on the first seed); None
        until its sweep is done. Variants that are not swept keep the scale's."""
        if not planned.variant.sweep_lr:
            return self.scale.lr
        grid, done = self.sweep_grid(root, planned)
        if not done:
            return None
        return min(grid, key=lambda lr: load_measures(root, self.job(planned, self.seeds[0], lr))["val_bpb"])

    def main_jobs(self, root: Path) -> list[tuple[Planned, int, Job | None]]:
        """(variant, seed, job) in seed-major order; job None while the variant's LR is not chosen."""
        out = []
        for seed in self.seeds:
            for p in self.variants:
                lr = self.tuned_lr(root, p)
                out.append((p, seed, None if lr is None else self.job(p, seed, lr)))
        return out

    def all_jobs(self, root: Path) -> list[Job | None]:
        return [job for _, _, job in self.sweep_jobs(root)] + [job for _, _, job in self.main_jobs(root)]


def make_plans(studies: list[Study], scale: Scale, seeds: list[int], data: str | None = None,
               cache_dir: str | None = None) -> list[StudyPlan]:
    return [StudyPlan(s, scale, plan(s, scale), seeds, data, cache_dir) for s in studies]


def pending(plans: list[StudyPlan], root: Path) -> list[tuple[Job, list[str]]]:
    """The next batch of runs not yet done, each once with the study/variant names it serves: the
    first study (in the order asked) with work left, its LR sweep first, then its variants seed by
    seed. Study by study, so an ablation cut short leaves whole studies with all their seeds."""
    for sp in plans:
        sweep = [(job, f"{sp.study.name}/{p.variant.name} lr {lr:g}") for p, lr, job in sp.sweep_jobs(root)]
        todo = sweep if any(sp.tuned_lr(root, p) is None for p in sp.variants) else [
            (job, f"{sp.study.name}/{p.variant.name}") for p, _, job in sp.main_jobs(root) if job is not None]
        merged: dict[str, tuple[Job, list[str]]] = {}
        for job, name in todo:
            if load_measures(root, job) is None:
                merged.setdefault(job.run_id, (job, []))[1].append(name)
        if merged:
            return list(merged.values())
    return []


def run_all(plans: list[StudyPlan], root: Path, *, jobs: int = 1, on_done=None, log=print,
            progress: bool = True, checkpoints: bool = True) -> int:
    """Run every pending job (batch after batch) in this process (`jobs` 1) or in `jobs` worker
    processes; `on_done(job)` after each finished run (the reports are rewritten as results arrive).
    Returns the number of runs trained."""
    trained = 0
    while True:
        batch = pending(plans, root)
        if not batch:
            return trained
        log(f"{len(batch)} runs to go in this batch")

        def finished(job: Job, names: list[str], m: dict, started: float) -> None:
            nonlocal trained
            trained += 1
            log(f"done [{trained}] {', '.join(names)} seed {job.settings.seed}: val bpb {m['val_bpb']:.4f} "
                f"({time.perf_counter() - started:.0f} s, {run_dir(root, job)})")
            if on_done:
                on_done(job)
        if jobs <= 1:
            for job, names in batch:
                log(f"training {', '.join(names)} seed {job.settings.seed} -> {run_dir(root, job)}")
                t0 = time.perf_counter()
                finished(job, names, execute(str(root), job.settings, progress=progress, log=log,
                                             checkpoints=checkpoints), t0)
        else:
            t0 = time.perf_counter()
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(_execute_quietly, str(root), _device_for(job.settings, i, jobs), checkpoints): (job, names)
                           for i, (job, names) in enumerate(batch)}
                for future in as_completed(futures):
                    finished(*futures[future], future.result(), t0)


def _device_for(settings: TrainSettings, i: int, jobs: int) -> TrainSettings:
    """Parallel CUDA jobs go round-robin over the GPUs (`--jobs` = GPUs on one host)."""
    if settings.device == "cuda":
        return dataclasses.replace(settings, device=f"cuda:{i % jobs}")
    return settings
