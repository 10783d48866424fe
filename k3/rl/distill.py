"""`k3 distill`: Multi-Teacher On-Policy Distillation (MOPD, DESIGN §13.3) of RL experts into one student.

Each iteration the student samples its own episodes for every teacher's (domain, effort): `prompts`
training prompts of that teacher's domain, rendered at its effort level, K samples each, through the
same rollout engine as `k3 rl` (partial rollout included). The teacher of that (domain, effort)
scores every sampled token, and the per-token signal is

    A_t = log pi_teacher(y_t) - log mu(y_t)      (mu: the student policy that sampled y_t)

the negative of the single-sample reverse-KL estimate log mu - log pi_teacher on the student's own
states: following its gradient with the clipped per-token objective of `k3 rl` (k3/rl/objective.py)
moves the student toward the teacher exactly where the student goes, and the teacher is never asked
about states the student would not reach. Teachers run in the same process (their latest
checkpoints, frozen); tool results come from the same tools as in RL.

Held-out evaluation runs each teacher's held-out prompts at its effort level through the student
(greedy), beside the teacher's own final figures from its run, so the report shows per expert how
far the student is from its teacher and whether lengths keep the effort order.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from k3.checkpoint.files import CheckpointError
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import pin
from k3.rl.effort import EFFORTS, Budget, episode_length, load_budgets, summarize
from k3.rl.episode_rows import train_rows
from k3.rl.objective import ObjectiveConfig, pack_trajectories, token_logprobs
from k3.rl.rollout import Prompt, Trajectory
from k3.rl.trainer import BUDGETS_FILE, HELDOUT_FILE, RLTrainer, RolloutSettings, check, validate_rollout
from k3.tasks.domains import Task, make_domain
from k3.tasks.episodes import run_episodes
from k3.text.tokenizer import load_tokenizer
from k3.train.errors import TrainError
from k3.train.packing import windows_for_step
from k3.train.settings import settings
from k3.train.trainer import RUN_FILE


@settings
class DistillSettings(RolloutSettings):
    """Everything that defines a distillation run (saved as run.json; `--resume` reads it back).
    `init` is the student's start (an SFT run), `prompts` and `pool` are per teacher."""
    DEFAULTS: ClassVar[dict] = {"prompts": 2, "samples": 4}
    HELP: ClassVar[dict] = {
        "init": "the student starts from this run (a `k3 sft` run)",
        "out": "run folder (default runs/distill-<timestamp>)",
        "prompts": "new prompts per teacher and iteration, N",
        "pool": "training prompts per teacher, cycled",
    }
    teachers: list = field(default_factory=list)  # `k3 rl` run folders, one per (domain, effort)


@dataclass
class Teacher:
    name: str  # "<domain>-<effort>"
    run: Path
    domain: str
    effort: str
    tau: float
    model: torch.nn.Module
    pool: list[Task]
    heldout: list[Task]
    budgets: dict[str, Budget]
    accuracy: float | None  # the teacher's own final held-out accuracy (its metrics), None if absent
    mean_length: float | None


def _validate(s: DistillSettings, world_size: int) -> None:
    validate_rollout(s, world_size, "distill")
    check(bool(s.teachers), "at least one teacher is required: --teachers RUN_DIR [RUN_DIR ...]")
    check(all(isinstance(t, str) for t in s.teachers), "teachers must be run folders")


def _final_heldout(run: Path) -> dict | None:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    held = [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip()) if r.get("kind") == "heldout"]
    return held[-1] if held else None


class DistillTrainer(RLTrainer):
    SETTINGS = DistillSettings
    OPTIONAL_STRINGS = ("out", "cache_dir")

    @staticmethod
    def default_run_name(settings) -> str:
        return "distill"

    def _setup(self, settings: DistillSettings, resume: bool) -> None:
        _validate(settings, self.world.size)
        model = self._load_chat_model(settings, resume, "distillation")
        self.teachers = [self._teacher(i, Path(t), settings) for i, t in enumerate(settings.teachers)]
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise TrainError(f"two teachers train the same domain and effort: {names}")
        self.objective = ObjectiveConfig(settings.eps_low, settings.eps_high)
        self._write_run_files(settings, resume)
        self._write_pins()
        self._setup_model(model, resume=False)
        self.ref_model = None
        self.teacher_gap = []
        self._start_rollouts(resume)

    def _teacher(self, index: int, run: Path, s: DistillSettings) -> Teacher:
        try:
            cfg = json.loads((run / RUN_FILE).read_text())
            domain, effort = cfg["domain"], cfg["effort"]
            tau = cfg["tau"] if cfg.get("tau") is not None else EFFORTS[effort].tau
        except (OSError, ValueError, KeyError, TypeError) as e:  # TypeError: run.json not an object
            raise TrainError(f"teacher {run} is not a `k3 rl` run: {e}") from None
        try:
            checkpoint = pin(self.pins, f"teacher {index}", run)
        except (FileNotFoundError, ValueError) as e:
            raise TrainError(f"teacher {run}: {e}") from None
        if load_tokenizer(checkpoint).to_str() != self.tokenizer.to_str():
            raise TrainError(f"teacher {run} has another tokenizer than the student: distill within one pipeline")
        try:
            model = load_pretrained(checkpoint).to(self.world.device).eval().requires_grad_(False)
            budgets = load_budgets(run / BUDGETS_FILE)
        except (CheckpointError, ValueError) as e:
            raise TrainError(f"teacher {run}: {e}") from None
        dom = make_domain(domain, cfg.get("seed", 0), **cfg.get("domain_options", {}))
        final = _final_heldout(run)
        heldout = dom.heldout(s.heldout)
        missing = [t.id for t in heldout if t.id not in budgets]
        if missing:
            raise TrainError(f"teacher {run}: its budgets.json lacks {len(missing)} held-out prompts (e.g. {missing[0]}); "
                             f"use --heldout {cfg.get('heldout')} or fewer")
        return Teacher(f"{domain}-{effort}", run, domain, effort, tau, model, dom.tasks("train", s.pool), heldout,
                       budgets, final and final.get("accuracy"), final and final.get("mean_length"))

    # ------------------------------------------------------------------ rollout and scores
    def task_of(self, tag: dict) -> tuple[Task, str]:
        teacher = self.teachers[tag["teacher"]]
        return teacher.pool[tag["task"]], teacher.effort

    def prompts_per_iteration(self) -> int:
        return self.s.prompts * len(self.teachers)

    def _new_prompts(self, limit: int) -> list[Prompt]:
        """This iteration's prompts, teacher by teacher in turn (so a short top-up stays balanced)."""
        s = self.s
        chosen = [windows_for_step(len(t.pool), s.seed + j, self.step, s.prompts) for j, t in enumerate(self.teachers)]
        out = []
        for k in range(s.prompts):
            for j, teacher in enumerate(self.teachers):
                i = chosen[j][k]
                r = teacher.pool[i].render(self.chat, None, teacher.effort)
                out.append(Prompt(tuple(r.token_ids), tuple(r.boundaries), tag={"teacher": j, "task": i, "turn": 1}))
        return out[:limit]

    def score(self, completed):
        """Every turn of every completed episode trains; the advantages come per token from the teacher."""
        trained = [row for _, turns in completed for row in train_rows(turns)]
        correct = [task.verify([self._reply(t)[1] for t in turns]).correct for task, turns in completed]
        self.teacher_gap = []
        n = max(len(completed), 1)
        return trained, [0.0] * len(trained), {"accuracy": sum(correct) / n}

    @torch.no_grad()
    def token_advantages(self, batch, row: list[Trajectory]) -> torch.Tensor:
        """log pi_teacher - log mu at every sampled position, each trajectory scored by its own teacher."""
        teacher_lp = torch.zeros_like(batch.old_logprobs)
        starts = batch.cu_seqlens.tolist()
        for j, teacher in enumerate(self.teachers):
            mine = [n for n, t in enumerate(row) if t.tag["teacher"] == j]
            if not mine:
                continue
            sub = pack_trajectories([row[n] for n in mine], [0.0] * len(mine)).to(batch.old_logprobs.device)
            lp = token_logprobs(teacher.model, sub, temperature=self.s.temperature,
                                batch_invariant=self.s.batch_invariant, share_prompts=self.share_prompts)
            sub_starts = sub.cu_seqlens.tolist()
            for k, n in enumerate(mine):
                teacher_lp[starts[n]:starts[n + 1]] = lp[sub_starts[k]:sub_starts[k + 1]]
        adv = torch.where(batch.mask, teacher_lp - batch.old_logprobs, torch.zeros_like(teacher_lp))
        self.teacher_gap.append((float(adv.sum()), int(batch.mask.sum())))
        return adv

    def optimize(self, trained, advantages) -> dict:
        metrics = super().optimize(trained, advantages)
        gap, tokens = sum(g for g, _ in self.teacher_gap), sum(n for _, n in self.teacher_gap)
        metrics["teacher_gap"] = round(gap / max(tokens, 1), 6)  # mean log pi_T - log mu: -reverse KL estimate
        return metrics

    # ------------------------------------------------------------------ eval and outputs
    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None) -> dict:
        """Each teacher's held-out prompts at its effort, answered greedily by the student."""
        experts, episodes = {}, []
        for teacher in self.teachers:
            eps = run_episodes(self.model, self.chat, teacher.heldout, teacher.effort, self.s.max_tokens,
                               measure=episode_length(self.chat))
            experts[teacher.name] = summarize(eps, teacher.budgets, teacher.tau)
            episodes += eps
        self.last_episodes = episodes
        self.model.train()
        k = len(experts)
        mean = {key: sum(e[key] for e in experts.values()) / k for key in ("accuracy", "mean_length", "within_budget")}
        return {"kind": "heldout", "step": self.step, **mean, "episodes": len(episodes), "experts": experts}

    def eval_line(self, ev: dict) -> str:
        parts = ", ".join(f"{name} {e['accuracy']:.0%}/{e['mean_length']:.0f}" for name, e in ev["experts"].items())
        return f"step {self.step}: student held-out accuracy/length per expert: {parts}"

    def write_heldout(self) -> None:
        by_task = {t.id: t for teacher in self.teachers for t in teacher.heldout}
        tau = {t.id: (teacher.budgets[t.id], teacher.tau) for teacher in self.teachers for t in teacher.heldout}
        with (self.run_dir / HELDOUT_FILE).open("w") as f:
            for e in self.last_episodes:
                if e.task.id in by_task:
                    budget, t = tau[e.task.id]
                    f.write(json.dumps({**e.record(self.tokenizer), "budget": t * budget.b0}) + "\n")

    def write_outputs(self, records: list[dict], checkpoint: Path | None) -> None:
        from k3.rl.report import plot_rl, write_distill_report

        plot_rl(records, self.run_dir, title=f"{self.run_dir.name}: MOPD from {len(self.teachers)} experts")
        write_distill_report(self.run_dir, settings=dataclasses.asdict(self.s), params=self.params, records=records,
                             wall_time_s=self.elapsed, checkpoint=checkpoint,
                             teachers=[(t.name, t.accuracy, t.mean_length) for t in self.teachers])
