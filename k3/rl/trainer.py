"""`k3 rl`: one RL expert (a domain at an effort level) by group-relative policy gradient, with
partial rollout and effort budgets (DESIGN §13.2), on the pretraining Trainer's machinery.

One iteration = one optimizer step:
1. Rollout (k3/rl/rollout.py, the serving engine in process over the trainer's own model, QAT
   included): last iteration's unfinished trajectories first, then new training prompts x K
   samples, as many as top the total up to N x K (a bounded backlog). With stop_fraction (lambda)
   < 1 the rollout pauses once ceil(lambda N K) trajectories have finished; the rest keep their
   tokens, behaviour log-probs, per-token policy versions and generator state and are resumed
   first next iteration. A tool episode takes several
   turns: a finished turn that called a tool becomes a new trajectory whose prompt holds the tool
   results (k3/tasks/domains.py), resumed like any unfinished one (lambda = 1 runs it to the end now).
2. Reward: a finished episode is verified (domain verifier), its length T(y) measured, and
   `shaped_reward` gives -1 beyond tau * b0(x) (k3/rl/effort.py), else 1 / 0 for right / wrong.
3. Advantage: reward minus the mean reward of its group's episodes finished so far (this iteration's
   and earlier ones': partial rollout finishes a group over several iterations), applied to every
   sampled token of every turn of the episode.
4. Loss: the per-token clipped ratio against the behaviour log-probs plus an optional k3 KL to the
   init model (k3/rl/objective.py), token-averaged over the iteration; Per-Head Muon / AdamW, the
   schedule, the expert-balance update, exactly as `k3 train`; on one GPU the whole update (forward
   and backward of the padded rows, then the optimizer) replays as a CUDA graph (DESIGN §14.5).

Budgets b0(x): measured once at the start from the init (SFT) model's sampled episodes of every
training-pool and held-out task (`budget_samples` each), or read from `--budgets` (a `max` expert's
budgets.json, so `high` and `low` derive from the same b0). Kept in the run as budgets.json.

Exact resume: the checkpoint holds the model, optimizer, schedule, the unfinished and held
trajectories (with generator states) and the group rewards; the data of an iteration is a function
of (seed, step). The engine's prefix cache is dropped right after each checkpoint, so the iteration
after it starts from an empty cache whether or not the run was killed: a resumed run replays the
uninterrupted one bit for bit.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from dataclasses import field
from pathlib import Path
from typing import ClassVar

import torch

from k3.checkpoint.files import CheckpointError, read_json
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import latest_checkpoint, pin, read_pins, write_pins
from k3.config import K3Config
from k3.model.transformer import K3ForCausalLM
from k3.rl.effort import (
    EFFORTS,
    Budget,
    cold_start_budgets,
    episode_length,
    length_of,
    load_budgets,
    reference_length,
    sampled_figures,
    save_budgets,
    shaped_reward,
    summarize,
)
from k3.rl.episode_rows import train_rows
from k3.rl.objective import (
    ObjectiveConfig,
    RLBatch,
    group_advantages,
    pack_trajectories,
    pad_rl_batch,
    policy_terms,
    token_logprobs,
    trained_tokens,
)
from k3.rl.rollout import Prompt, Rollouts, Segment, Trajectory
from k3.sampling import MAX_TEMPERATURE
from k3.serve.engine import EngineConfig
from k3.tasks import shell
from k3.tasks.domains import DOMAIN_CLASSES, Task, make_domain, needs_another_turn
from k3.tasks.episodes import next_turn, run_episodes
from k3.train.chat_start import load_chat_start
from k3.train.errors import TrainError
from k3.train.graph_step import padded_docs, token_bucket
from k3.train.muon import OPTIMIZERS
from k3.train.packing import windows_for_step
from k3.train.settings import (
    BALANCE_RULES,
    CheckpointSettings,
    OptimizerSettings,
    RunSettings,
    StartSettings,
    option,
    settings,
)
from k3.train.trainer import MAX_GRAPH_SPAN, Trainer, validate_update

BUDGETS_FILE = "budgets.json"
HELDOUT_FILE = "heldout.jsonl"
TRAIN_ROW_TOKENS = 8192  # tokens per packed training forward (micro-batch)
BUDGET_BATCH = 128  # episodes per rollout call when measuring cold-start budgets (the engine queues)


@settings
class RolloutSettings(CheckpointSettings, OptimizerSettings, RunSettings, StartSettings):
    """What `k3 rl` and `k3 distill` runs share (each verb's settings add their own); the fields every
    training verb shares are declared in k3/train/settings.py, DEFAULTS holds these verbs' values.
    Its own fields are the rollout and objective section: flags in one group of both verbs."""
    TITLE = "rollout and objective"
    DEFAULTS: ClassVar[dict] = {
        "steps": 40, "eval_every": 10,
        "lr": 1e-4,  # 5e-4 under Per-Head Muon lowered held-out accuracy (LOG "RL and distillation")
        "min_lr_ratio": 1.0,  # constant after warmup
        "weight_decay": 0.0, "ckpt_every": 10, "keep": 2}
    HELP: ClassVar[dict] = {
        "steps": "iterations, one optimizer step each",
        "eval_every": "iterations between held-out evals",
        "min_lr_ratio": "the learning rate the cosine decays to, as a share of the peak (default {default}: "
                        "constant after warmup)",
    }
    prompts: int = option(8, "new prompts per iteration, N")
    samples: int = option(8, "completions per prompt, K")  # RL: the advantage group
    # lambda: pause the rollout once this share of those in flight has finished
    stop_fraction: float = option(1.0, "partial rollout: pause once this share of N*K has finished; the rest resume "
                                       "next iteration (default {default}: synchronous)")
    temperature: float = option(1.0, "rollout sampling temperature")
    # per assistant turn: a tool turn (think + call) runs ~100-130 tokens
    max_tokens: int = option(160, "tokens per assistant turn")
    pool: int = option(128, "training prompts, cycled")  # each has a cold-start budget
    heldout: int = option(64, "held-out prompts evaluated greedily")
    eps_low: float = option(0.2, "ratio clip floor 1 - eps")
    eps_high: float = option(0.2, "ratio clip ceiling 1 + eps")
    # rollout and trainer in k3.ops.batch_invariant's arithmetic (CPU)
    batch_invariant: bool = option(False, "rollouts and trainer in batch-invariant arithmetic (CPU, slower): "
                                          "recorded log-probs equal the trainer's bit for bit, QAT included")
    # shared prompts run once in the trainer (k3/rl/shared_prompts.py; not under compile)
    share_prompts: bool = option(True, "pack every trajectory whole in the trainer's forward instead of running "
                                       "each distinct prompt once (same loss; K times the prompt tokens)")


@settings
class RLSettings(RolloutSettings):
    """Everything that defines an RL run (saved as run.json; `--resume` reads it back)."""
    HELP: ClassVar[dict] = {
        "init": "start from this run's latest checkpoint (a `k3 sft` run, or the expert one effort up)",
        "out": "run folder (default runs/rl-<domain>-<effort>-<timestamp>)",
    }
    domain: str = "arithmetic"  # arithmetic | strings | tool (k3/tasks/domains.py)
    domain_options: dict = field(default_factory=dict)  # max_level, tail, digits (arithmetic), n_tools (tool)
    effort: str = "max"  # low | high | max: the XTML effort message and the default tau
    tau: float | None = None  # budget multiple; None: the effort level's (max 2, high 1, low 0.5)
    budgets: str | None = None  # a budgets.json to use (a max expert's); None: the init run's, else measured
    budget_samples: int = 4  # SFT samples per prompt for b0(x)
    kl_coef: float = 0.0  # weight of the per-token k3 KL to the init model
    normalize_std: bool = False  # divide advantages by the group's reward std
    filter_groups: bool = False  # train only episodes with a nonzero advantage (DAPO's group filter)
    sandboxes: int = 8  # shell: warm sandboxes in the pool (k3/tasks/shell.py)
    sandbox_memory_mb: int = 512  # shell: each sandbox's memory budget, all its processes together

    @property
    def tau_value(self) -> float:
        return self.tau if self.tau is not None else EFFORTS[self.effort].tau


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise TrainError(msg)


def validate_rollout(s: RolloutSettings, world_size: int, verb: str, kl_coef: float = 0.0) -> None:
    """The checks every rollout verb's settings share (one-line TrainErrors)."""
    check(bool(s.init), "an initial checkpoint is required: --run RUN_DIR or --model CHECKPOINT_DIR")
    check(world_size == 1, f"k3 {verb} runs in one process (the rollout engine drives the whole model); "
                           "launch it without torchrun")
    check(s.steps >= 1 and s.prompts >= 1 and s.samples >= 1, "steps, prompts and samples must be >= 1")
    check(0 < s.stop_fraction <= 1, f"stop fraction must be in (0, 1], got {s.stop_fraction}")
    # the serving engine's range, checked here before anything is written
    check(0 < s.temperature <= MAX_TEMPERATURE,
          f"temperature must be in (0, {MAX_TEMPERATURE:g}] (rollouts sample), got {s.temperature}")
    check(s.max_tokens >= 1 and s.pool >= 1 and s.heldout >= 1, "max tokens, pool and heldout must be >= 1")
    validate_update(s)
    check(0 < s.min_lr_ratio <= 1, f"min lr ratio must be in (0, 1], got {s.min_lr_ratio}")
    check(s.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {s.optimizer!r}")
    check(s.balance in BALANCE_RULES, f"balance rule must be one of {', '.join(BALANCE_RULES)}, got {s.balance!r}")
    check(s.keep >= 1 and s.ckpt_every >= 1 and s.eval_every >= 1, "keep, ckpt-every and eval-every must be >= 1")
    check(not (s.batch_invariant and s.device != "cpu"), "--batch-invariant runs on CPU only")
    try:
        ObjectiveConfig(s.eps_low, s.eps_high, kl_coef)
    except ValueError as e:
        raise TrainError(str(e)) from None


def _validate(s: RLSettings, world_size: int) -> None:
    validate_rollout(s, world_size, "rl", s.kl_coef)
    check(s.domain in DOMAIN_CLASSES, f"domain must be one of {', '.join(DOMAIN_CLASSES)}, got {s.domain!r}")
    check(s.effort in EFFORTS, f"effort must be one of {', '.join(EFFORTS)}, got {s.effort!r}")
    check(s.tau is None or s.tau > 0, f"tau must be > 0, got {s.tau}")
    check(s.samples >= 2, f"samples per prompt must be >= 2 (the group is the baseline), got {s.samples}")
    check(s.budget_samples >= 1, f"budget samples must be >= 1, got {s.budget_samples}")
    check(s.sandboxes >= 1 and s.sandbox_memory_mb >= 16,
          f"sandboxes must be >= 1 and sandbox memory >= 16 MB, got {s.sandboxes} and {s.sandbox_memory_mb}")
    try:
        make_domain(s.domain, s.seed, **s.domain_options)
    except (ValueError, TypeError) as e:
        raise TrainError(str(e)) from None


# ---- trajectories in a checkpoint (JSON: floats round-trip exactly through repr)

def _dump(t: Trajectory) -> dict:
    d = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in ("rng_state", "segments")}
    d["boundaries"] = list(t.boundaries)
    d["segments"] = [dataclasses.astuple(x) for x in t.segments]
    d["rng_state"] = None if t.rng_state is None else base64.b64encode(t.rng_state.numpy().tobytes()).decode()
    return d


def _load(d: dict) -> Trajectory:
    d = dict(d)
    rng = d.pop("rng_state")
    segments = [Segment(*x) for x in d.pop("segments")]
    t = Trajectory(**{**d, "boundaries": tuple(d["boundaries"])}, segments=segments)
    if rng is not None:
        t.rng_state = torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8).clone()
    return t


def _seed_of(uid: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"k3-rl-turn/{uid}".encode(), digest_size=8).digest(), "little") >> 1


class RLTrainer(Trainer):
    SETTINGS = RLSettings
    CHAT_MODEL = True
    OPTIONAL_STRINGS = ("budgets", "out", "cache_dir")
    OPTIONAL_FLOATS = ("tau",)
    OWN_GRAPH_STEP = True  # optimize() replays the update (the rollouts run eagerly, on the serving engine)
    init_sampled: dict | None = None  # the init model's held-out pass@k, when this run measures the budgets

    @staticmethod
    def default_run_name(settings) -> str:
        return f"rl-{settings.domain}-{settings.effort}"

    # ------------------------------------------------------------------ setup
    def _setup(self, settings: RLSettings, resume: bool) -> None:
        _validate(settings, self.world.size)
        model = self._load_chat_model(settings, resume, "RL")
        self.domain = make_domain(settings.domain, settings.seed, **settings.domain_options)
        if settings.domain == "shell":
            shell.configure(settings.sandboxes, memory_bytes=settings.sandbox_memory_mb << 20)
        self.pool: list[Task] = self.domain.tasks("train", settings.pool)
        self.heldout_tasks: list[Task] = self.domain.heldout(settings.heldout)
        self.objective = ObjectiveConfig(settings.eps_low, settings.eps_high, settings.kl_coef)
        budgets = self._given_budgets(settings) if not resume else None
        self._write_run_files(settings, resume)
        self._write_pins()
        self._setup_model(model, resume=False)
        self.ref_model = None
        if settings.kl_coef > 0:
            self.ref_model = load_pretrained(self.init_checkpoint).to(self.world.device).eval().requires_grad_(False)
        self._start_rollouts(resume)  # before the budgets: a fresh run measures them through the engine
        self.budgets = self._budgets(budgets)

    def _load_chat_model(self, settings: RolloutSettings, resume: bool, verb: str) -> K3ForCausalLM:
        """The run folder, the init model (on resume: an empty one of the run's own config, which the
        checkpoint fills), its tokenizer and the XTML renderer (TrainError if it is no chat model)."""
        self._prepare_run_dir(settings, resume)
        own = latest_checkpoint(self.run_dir / "checkpoints") if resume else None
        try:
            self.pins = read_pins(self.run_dir) if resume else {}
            self.pins_read = dict(self.pins)
            # a resumed run needs its init only as the KL reference: without one it may have moved
            needs_init = own is None or getattr(settings, "kl_coef", 0.0) > 0
            self.init_checkpoint = pin(self.pins, "init", settings.init) if needs_init else None
            if own is not None:
                model = K3ForCausalLM(K3Config.from_dict(read_json(own / "config.json")))
            else:
                model = load_pretrained(self.init_checkpoint)
        except (FileNotFoundError, CheckpointError, ValueError) as e:
            raise TrainError(f"cannot load the initial checkpoint: {e}") from None
        self._adopt_chat(load_chat_start(model.config, self.run_dir if resume else self.init_checkpoint, settings.init,
                                         verb, settings.init, f"{verb} needs a chat model (a `k3 sft` run)"), model.config)
        return model

    def close(self) -> None:
        shell.release()  # the sandboxes of shell episodes still paused when the run ends
        super().close()

    def _write_pins(self) -> None:
        """sources.json: the init (and teacher) checkpoints as resolved now, read back on resume."""
        if self.world.is_main and self.pins != self.pins_read:
            write_pins(self.run_dir, self.pins)
            self.pins_read = dict(self.pins)

    def _start_rollouts(self, resume: bool) -> None:
        """The rollout engine over the model, empty rollout state; on resume the latest checkpoint."""
        s = self.s
        self.rollouts = Rollouts(self.model, EngineConfig(batch_invariant=s.batch_invariant, seed=s.seed,
                                                          cuda_graphs=False),
                                 xtml=self.chat, temperature=s.temperature, max_tokens=s.max_tokens)
        self.unfinished: list[Trajectory] = []  # resumed first next iteration
        self.held: dict[str, list[Trajectory]] = {}  # episode -> its finished turns, while a later turn runs
        self.group_rewards: dict[str, list[float]] = {}  # group -> rewards of its finished episodes
        self.last_episodes: list = []
        if resume:
            self._restore_latest()

    def _given_budgets(self, s: RLSettings) -> dict[str, Budget] | None:
        """b0 from --budgets, else from the init run's budgets.json when it trained the same domain."""
        path = Path(s.budgets) if s.budgets else None
        if path is None:
            init = Path(s.init)
            candidate = init / BUDGETS_FILE if (init / BUDGETS_FILE).is_file() else None
            if candidate is not None and self._same_domain(init):
                path = candidate
        if path is None:
            return None
        try:
            budgets = load_budgets(path)
        except ValueError as e:
            raise TrainError(str(e)) from None
        missing = [t.id for t in self.pool + self.heldout_tasks if t.id not in budgets]
        if missing:
            raise TrainError(f"{path} has no budget for {len(missing)} of this run's tasks (e.g. {missing[0]}): "
                             "it was measured for another domain, seed or pool")
        return budgets

    def _same_domain(self, run: Path) -> bool:
        try:
            other = json.loads((run / "run.json").read_text())
        except (OSError, ValueError):
            return False
        return all(other.get(k) == getattr(self.s, k) for k in ("domain", "domain_options", "seed"))

    def _budgets(self, given: dict[str, Budget] | None) -> dict[str, Budget]:
        path = self.run_dir / BUDGETS_FILE
        if path.is_file():
            return load_budgets(path)
        if given is None:
            given = self._measure_budgets()
        save_budgets(path, given.values())
        return given

    def _measure_budgets(self) -> dict[str, Budget]:
        """b0(x) of every pool and held-out task: the median T(y) of the init model's correct samples,
        `budget_samples` episodes per task sampled at max effort through the rollout engine (each task
        a group: its prompt is computed once, and the shared system prefix once for all)."""
        s = self.s
        tasks = self._measured = self.pool + self.heldout_tasks
        per_call = max(1, BUDGET_BATCH // s.budget_samples)
        n = len(tasks) * s.budget_samples
        self.log(f"measuring cold-start budgets: {n} sampled episodes of the init model ...")
        t0 = time.perf_counter()
        samples: dict[str, list[tuple[bool, int]]] = {t.id: [] for t in tasks}
        for call, start in enumerate(range(0, len(tasks), per_call)):
            prompts = [self._prompt(tasks[j], "max", {"measure": j, "turn": 1})
                       for j in range(start, min(start + per_call, len(tasks)))]
            # seeds below the training iterations' (seed * 1_000_003 + step + 1, step >= 0)
            completed, _, _ = self._play(prompts, s.budget_samples, [], s.seed * 1_000_003 - call, 1.0)
            for task, turns in completed:
                samples[task.id].append(self.outcome(task, turns))
        self.rollouts.reset_cache()  # iteration 1 starts from an empty cache, as a resumed run would
        reference = {t.id: reference_length(t, self.chat) for t in tasks}
        budgets = cold_start_budgets(samples, s.domain, reference=reference)
        solved = sum(b.n_correct > 0 for b in budgets.values())
        self.log(f"budgets: {solved} of {len(budgets)} prompts solved at least once by the init model "
                 f"({time.perf_counter() - t0:.0f} s)")
        self.init_sampled = sampled_figures(budgets[t.id] for t in self.heldout_tasks)
        if self.init_sampled is not None:
            f = self.init_sampled
            self.log(f"init model on the held-out prompts, sampled: pass@{f['k']} {f['pass_at_k']:.1%}, "
                     f"accuracy {f['accuracy']:.1%} (what sharpening can reach)")
        return budgets

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        return {"elapsed": self.elapsed, "tokens_seen": self.tokens_seen, "world_size": 1,
                "settings": dataclasses.asdict(self.s), "unfinished": [_dump(t) for t in self.unfinished],
                "held": {k: [_dump(t) for t in v] for k, v in self.held.items()},
                "group_rewards": self.group_rewards}

    def restore_state(self, state: dict) -> None:
        self.unfinished = [_load(d) for d in state["unfinished"]]
        self.held = {k: [_load(d) for d in v] for k, v in state["held"].items()}
        self.group_rewards = state["group_rewards"]
        self.rollouts.policy_version = self.step

    def _save(self) -> Path:
        path = super()._save()
        self.rollouts.reset_cache()  # the next iteration starts as a resumed run would: exact resume
        return path

    # ------------------------------------------------------------------ one iteration
    def _new_prompts(self, limit: int) -> list[Prompt]:
        """At most `limit` of this iteration's training prompts (a function of seed and step)."""
        s = self.s
        return [self._prompt(self.pool[i], s.effort, {"task": i, "turn": 1})
                for i in windows_for_step(len(self.pool), s.seed, self.step, s.prompts)[:limit]]

    def _prompt(self, task: Task, effort: str, tag: dict) -> Prompt:
        r = task.render(self.chat, None, effort)
        return Prompt(tuple(r.token_ids), tuple(r.boundaries), tag=tag)

    def task_of(self, tag: dict) -> tuple[Task, str]:
        """The task a trajectory's tag names, and the effort level it is rendered at."""
        if "measure" in tag:  # a cold-start budget episode (pool, then held-out tasks), at max effort
            return self._measured[tag["measure"]], "max"
        return self.pool[tag["task"]], self.s.effort

    def prompts_per_iteration(self) -> int:
        return self.s.prompts

    def _reply(self, t: Trajectory):
        task, effort = self.task_of(t.tag)
        rendered = task.render(self.chat, t.tag.get("messages"), effort)
        return task, self.chat.parse_reply(rendered, t.completion_ids)

    def _continuation(self, t: Trajectory, episode: str, task: Task, reply) -> Trajectory:
        """The next turn of a tool episode, as a fresh trajectory whose prompt is this turn's prompt
        and reply as sampled, then the tool results (token in / token out, k3/tasks/episodes.py)."""
        nxt = next_turn(self.chat, task, self.task_of(t.tag)[1], t.tag.get("messages"), reply, t.prompt_ids,
                        t.completion_ids, t.boundaries)
        turn = t.tag["turn"] + 1
        uid = f"{episode}+{turn}"
        return Trajectory(uid, t.group_id, t.group, t.sample, nxt.token_ids, _seed_of(uid), self.s.max_tokens,
                          nxt.boundaries, {**t.tag, "turn": turn, "episode": episode, "messages": nxt.messages})

    def rollout(self) -> tuple[list[tuple[Task, list[Trajectory]]], dict]:
        """One iteration's rollout: the episodes it completed (task, turns) and rollout stats."""
        s = self.s
        carry = self.unfinished
        # partial rollout keeps at most one iteration's N * K trajectories in flight: new prompts
        # top the resumed ones up to it, so the paused backlog and its staleness stay bounded
        capacity = self.prompts_per_iteration() * s.samples
        prompts = self._new_prompts(max(0, (capacity - len(carry)) // s.samples))
        self.unfinished = []
        completed, self.unfinished, stats = self._play(prompts, s.samples, carry, s.seed * 1_000_003 + self.step + 1,
                                                       s.stop_fraction)
        return completed, {**stats, "resumed": len(carry), "new": len(prompts) * s.samples}

    def _play(self, prompts: list[Prompt], samples: int, carry: list[Trajectory], seed: int,
              stop_fraction: float) -> tuple[list[tuple[Task, list[Trajectory]]], list[Trajectory], dict]:
        """Roll `prompts` x `samples` out after `carry`: the episodes completed (task, turns), the
        trajectories left unfinished (paused ones, and next turns of tool episodes), token stats. With
        stop_fraction 1 every episode runs to its end, each tool turn as a new request."""
        completed = []
        stats = {"rollout_tokens": 0, "prefix_hits": 0}
        while True:
            batch = self.rollouts.run(prompts, samples, stop_fraction=stop_fraction, resume=carry, seed=seed)
            stats["rollout_tokens"] += batch.new_tokens
            stats["prefix_hits"] += batch.prefix_hits
            prompts, continuations = [], []
            for t in batch.finished:
                episode = t.tag.get("episode", t.uid)
                turns = self.held.pop(episode, []) + [t]
                task, reply = self._reply(t)
                if t.finish_reason == "stop" and needs_another_turn(task, reply, t.tag["turn"]):
                    self.held[episode] = turns
                    continuations.append(self._continuation(t, episode, task, reply))
                else:
                    completed.append((task, turns))
            carry = continuations + batch.unfinished
            if stop_fraction < 1 or not carry:  # lambda = 1: every episode runs to its end now
                return completed, carry, stats

    def outcome(self, task: Task, turns: list[Trajectory]) -> tuple[bool, int]:
        """Whether an episode is correct (the domain's verifier) and its T(y)."""
        correct = task.verify([self._reply(t)[1] for t in turns]).correct
        return correct, length_of([t.completion_ids for t in turns], task.domain, self.chat)

    def reward(self, task: Task, turns: list[Trajectory]) -> tuple[float, bool, int]:
        """An episode's shaped reward, whether it is correct, and its T(y)."""
        correct, length = self.outcome(task, turns)
        return shaped_reward(correct, length, self.budgets[task.id].b0, self.s.tau_value), correct, length

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        completed, stats = self.rollout()
        t_rollout = time.perf_counter() - t0
        trained, advantages, record = self.score(completed)
        metrics = self.optimize(trained, advantages)
        return {"kind": "train", "step": self.step, **metrics, **record, "episodes": len(completed),
                "unfinished": len(self.unfinished), "held": sum(len(v) for v in self.held.values()),
                "rollout_s": round(t_rollout, 2), "step_tokens": metrics["trained_tokens"] + stats["rollout_tokens"],
                "prefix_hits": stats["prefix_hits"], "resumed": stats["resumed"], "new": stats["new"]}

    def score(self, completed: list[tuple[Task, list[Trajectory]]]) -> tuple[list[Trajectory], list[float], dict]:
        """Rewards of the completed episodes and the group-relative advantage of each of their turns."""
        s, tau = self.s, self.s.tau_value
        rewards, correct, lengths, within = [], [], [], []
        for task, turns in completed:
            r, ok, length = self.reward(task, turns)
            rewards.append(r)
            correct.append(ok)
            lengths.append(length)
            within.append(length <= tau * self.budgets[task.id].b0)
            self.group_rewards.setdefault(turns[0].group_id, []).append(r)
        # each group's members so far (partial rollout: earlier iterations' too); one reward, one advantage
        advantage = {}
        for g in dict.fromkeys(turns[0].group_id for _, turns in completed):
            group = self.group_rewards[g]
            values = group_advantages(group, [g] * len(group), normalize_std=s.normalize_std).tolist()
            advantage.update(((g, r), a) for r, a in zip(group, values))
        trained, advantages = [], []
        for (task, turns), r in zip(completed, rewards):
            for row in train_rows(turns):  # a tool episode: one row, its replies trained
                trained.append(row)
                advantages.append(advantage[turns[0].group_id, r])
        for g in [g for g, v in self.group_rewards.items() if len(v) >= s.samples]:
            del self.group_rewards[g]  # every episode of the group has trained
        n, before = max(len(completed), 1), len(trained)
        if s.filter_groups and any(advantages):
            # a zero advantage (a group of equal rewards) has no policy gradient; left in, its tokens only
            # dilute the token mean and cost a forward and backward (DAPO, arXiv:2503.14476 §3.2)
            kept = [(t, a) for t, a in zip(trained, advantages) if a != 0.0]
            trained, advantages = [t for t, _ in kept], [a for _, a in kept]
        return trained, advantages, {"reward": sum(rewards) / n, "accuracy": sum(correct) / n,
                                     "mean_length": sum(lengths) / n, "within_budget": sum(within) / n,
                                     "filtered": before - len(trained)}

    @property
    def share_prompts(self) -> bool:
        """Shared prompt tokens run once in the trainer's forwards; not under --compile, whose
        regions are traced for whole rows, nor in captured steps, whose rows have fixed shapes."""
        return self.s.share_prompts and not self.s.compile and self.graphs is None

    def token_advantages(self, batch, row: list[Trajectory]) -> torch.Tensor:
        """Each position's advantage (RL: its trajectory's, as packed)."""
        return batch.advantages

    def optimize(self, trained: list[Trajectory], advantages: list[float]) -> dict:
        """One optimizer step on the trained trajectories: the clipped per-token objective,
        token-averaged; through a captured step (DESIGN §14.5) when the run replays them."""
        version = self.rollouts.policy_version
        total = sum(trained_tokens(t) for t in trained)
        rows = [(pack_trajectories(row, adv), row) for row, adv in self._rows(trained, advantages)]
        # policy versions are on the host: staleness never waits on the device
        staleness = sum(float((version - b.versions[b.mask]).float().sum()) / max(total, 1) for b, _ in rows)
        self.model.train()
        tokens = token_bucket(max((b.input_ids.shape[1] for b, _ in rows), default=0))
        if self.graphs is not None and rows and tokens <= MAX_GRAPH_SPAN:
            out, lr = self._graph_optimize(rows, tokens, total)
        else:
            out, lr = self._eager_optimize(rows, total, trained)
        values = dict(zip(out, torch.stack([v.float() for v in out.values()]).tolist()))  # the one host read
        self.rollouts.policy_version = self.step
        self.tokens_seen += total
        loss, grad_norm = values.pop("loss", 0.0), values.pop("grad_norm")
        if rows:
            values["staleness"] = staleness
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens_seen, "trained_tokens": total,
                **{k: round(v, 6) for k, v in values.items()}}

    def _eager_optimize(self, rows: list, total: int, trained: list) -> tuple[dict[str, torch.Tensor], float]:
        """The rows as packed, forward and backward one by one, then the optimizer step."""
        device = self.world.device
        self.optimizer.zero_grad(set_to_none=True)  # a replayed step leaves its gradients set
        batches = []
        for b, row in rows:
            batch = b.to(device)
            batch.advantages = self.token_advantages(batch, row)
            batches.append(batch)
        out = self._train_rows(batches, total)
        rule = self.balance_rule
        if not trained:  # partial rollout finished no episode (multi-turn ones span iterations): nothing was routed
            self.balance_rule = None
        try:
            grad_norm, lr, _ = self.optimizer_step()
        finally:
            self.balance_rule = rule
        return {**out, "grad_norm": grad_norm}, lr

    def _graph_optimize(self, rows: list, tokens: int, total: int) -> tuple[dict[str, torch.Tensor], float]:
        """The rows padded to one shape (`tokens` positions, a document bucket), then the captured step."""
        docs = padded_docs([b for b, _ in rows], tokens)
        batches = []
        for b, row in rows:
            batch = pad_rl_batch(b, tokens, docs, self.config.pad_token_id).to(self.world.device)
            batch.advantages = self.token_advantages(batch, row)  # distillation: the teachers' forwards, eager
            batches.append(batch)
        lr = self.scheduler.get_last_lr()[0]
        out = self.graphs.run(batches, float(total))
        self.scheduler.step()
        self.step += 1
        return out, lr

    def _graph_body(self, batches: list[RLBatch], total: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step a graph captures: forward and backward of each padded row (the loss divided by
        the device scalar `total`), clip, update, balance."""
        self.model.train()
        out = self._train_rows(batches, total)
        grad_norm, _ = self._update(self.real_tokens(batches))
        return {**out, "grad_norm": grad_norm}

    def _train_rows(self, batches: list[RLBatch], total) -> dict[str, torch.Tensor]:
        """Forward and backward of each packed row, the loss divided by `total` (the step's trained
        tokens); the step's metrics on the device: loss and pg_loss summed over rows, ratio_max the
        largest, the rest token means."""
        s, out = self.s, {}
        for batch in batches:
            logp, entropy = token_logprobs(self.model, batch, temperature=s.temperature, with_entropy=True,
                                           batch_invariant=s.batch_invariant, share_prompts=self.share_prompts)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.ref_model, batch, temperature=s.temperature,
                                         batch_invariant=s.batch_invariant, share_prompts=self.share_prompts)
            loss, m = policy_terms(logp, batch.old_logprobs, batch.advantages, batch.mask, self.objective,
                                   seq_ids=batch.seq_ids, ref_logprobs=ref, entropy=entropy, num_tokens=total)
            loss.backward()
            w = m.pop("tokens") / total
            for k, v in m.items():
                if k not in out:
                    out[k] = v if k in ("loss", "pg_loss", "ratio_max") else v * w
                elif k == "ratio_max":
                    out[k] = torch.maximum(out[k], v)
                else:
                    out[k] = out[k] + (v if k in ("loss", "pg_loss") else v * w)
        return out

    def graph_span(self) -> int:
        """Trajectories pack into rows of TRAIN_ROW_TOKENS (a longer one alone: that step runs eagerly)."""
        return TRAIN_ROW_TOKENS

    def _graph_refusal(self) -> str | None:
        why = super()._graph_refusal()
        return why or ("--batch-invariant (CPU arithmetic, host reads)" if self.s.batch_invariant else None)

    @staticmethod
    def _rows(trajectories: list[Trajectory], advantages: list[float]):
        """Micro-batches of at most TRAIN_ROW_TOKENS tokens (a longer trajectory alone)."""
        row, adv, size = [], [], 0
        for t, a in zip(trajectories, advantages):
            n = len(t.prompt_ids) + len(t.completion_ids)
            if row and size + n > TRAIN_ROW_TOKENS:
                yield row, adv
                row, adv, size = [], [], 0
            row.append(t)
            adv.append(a)
            size += n
        if row:
            yield row, adv

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None) -> dict:
        """Greedy held-out episodes: accuracy, mean T(y), share within tau * b0(x)."""
        s = self.s
        episodes = run_episodes(self.model, self.chat, self.heldout_tasks, s.effort, s.max_tokens,
                                measure=episode_length(self.chat))
        self.last_episodes = episodes
        self.model.train()
        return {"kind": "heldout", "step": self.step, **summarize(episodes, self.budgets, s.tau_value)}

    def eval_line(self, ev: dict) -> str:
        return (f"step {self.step}: held-out accuracy {ev['accuracy']:.1%}, mean length {ev['mean_length']:.1f}, "
                f"within budget {ev['within_budget']:.1%} ({ev['episodes']} prompts)")

    def samples(self, temperature: float = 0.0, top_p: float = 1.0) -> list[dict]:
        return [{"kind": "sample", "step": self.step, "prompt": e.task.messages[-1]["content"],
                 "text": "\n" + "\n".join(self.tokenizer.decode(t, skip_special_tokens=False) for t in e.turns)}
                for e in self.last_episodes[:2]]

    # ------------------------------------------------------------------ outputs
    def train(self) -> dict:
        baseline = self.step == 0 and not any(r["kind"] == "heldout" for r in self.metrics.read())
        if baseline:  # the init model's held-out figures (once: a resume before step 1 keeps them)
            ev = self.evaluate()
            sampled = [{"kind": "init_sampled", "step": 0, **self.init_sampled}] if self.init_sampled else []
            self._record([*sampled, ev, *self.samples()])
            self.log(self.eval_line(ev))
        result = super().train()
        if self.world.is_main:
            self.write_heldout()
        return result

    def write_heldout(self) -> None:
        """heldout.jsonl: the last evaluation's episodes, one per line."""
        tau = self.s.tau_value
        with (self.run_dir / HELDOUT_FILE).open("w") as f:
            for e in self.last_episodes:
                f.write(json.dumps({**e.record(self.tokenizer), "budget": tau * self.budgets[e.task.id].b0}) + "\n")

    def write_outputs(self, records: list[dict], checkpoint: Path | None) -> None:
        from k3.rl.report import plot_rl, write_rl_report

        plot_rl(records, self.run_dir, title=f"{self.run_dir.name}: {self.s.domain} at {self.s.effort} effort")
        write_rl_report(self.run_dir, settings=dataclasses.asdict(self.s), params=self.params, records=records,
                        wall_time_s=self.elapsed, checkpoint=checkpoint, tau=self.s.tau_value)

