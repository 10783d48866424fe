"""The pretraining loop as an importable Trainer (the `k3 train` verb is a thin wrapper).

One optimizer step = `batch_size` windows of `seq_len` tokens (the global batch), split over ranks
and then into `grad_accum` micro-batches; each micro-batch is one packed row with cu_seqlens.
The loss is the mean next-token cross-entropy over the global batch's targets: every rank divides
its summed NLL by the global target count (known without communication, windows are a pure
function of the step) times the world size, because FSDP averages gradients over ranks.
After each step: gradient clipping, Per-Head Muon + AdamW, the warmup-cosine schedule, then the
expert-balance update (DESIGN §6: QB by default, used from the next step on).

Everything a step depends on is a function of (settings, step, saved state): data order from the
seed and step, no dropout, eval and sampling use no global RNG. So a resumed run replays the same
losses bit for bit on CPU.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import torch
from torch.nn import functional as F

from k3 import threads
from k3.atomic import write_atomic, write_text_atomic
from k3.cache_dir import resolve_cache_dir
from k3.checkpoint import training_state as ckpt
from k3.checkpoint.run_folder import latest_checkpoint
from k3.config import PRESETS, ConfigError, K3Config, load_config
from k3.data.copy_corpus import copy_documents
from k3.data.corpus import load_documents, split_documents
from k3.generation.generate import generate
from k3.model.params import count_parameters
from k3.model.transformer import K3ForCausalLM
from k3.text.tokenizer import (
    MIN_VOCAB_SIZE,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    token_bytes,
    tokenizer_fingerprint,
    train_tokenizer,
)
from k3.train.balance import balance_step, max_load
from k3.train.chat_start import ChatStart
from k3.train.errors import TrainError
from k3.train.graph_step import GraphStep, StepOutputs, token_bucket
from k3.train.init import INITS, init_for_training
from k3.train.metrics import PLOT_FILE, REPORT_FILE, MetricsLog, plot_losses, write_report
from k3.train.muon import OPTIMIZERS, PerHeadMuon, param_groups
from k3.train.packing import IGNORE_INDEX, cached_token_stream, pack, window, windows_for_step
from k3.train.parallel import (
    World,
    all_reduce_sum,
    barrier,
    broadcast_object,
    clip_grad_norm_,
    init_world,
    shutdown,
)
from k3.train.progress import Progress
from k3.train.schedule import warmup_cosine
from k3.train.settings import (
    BALANCE_RULES,
    BatchSettings,
    CheckpointSettings,
    DataSettings,
    OptimizerSettings,
    RunSettings,
    settings,
)
from k3.train.transforms import apply_transforms
from k3.train.vl_config import VL_PRESETS

RUN_FILE = "run.json"
EVAL_ROW_TOKENS = 4096  # tokens per eval forward (no backward, so rows can be long)
# a default eval reads the whole validation split up to this many tokens (the bundled play is 45,602), so
# a large user corpus does not spend more time evaluating than training; the same tokens every eval
MAX_EVAL_TOKENS = 262_144
MAX_GRAPH_SPAN = 16_384  # captured steps attend with a dense document mask: O(span^2) per window or row
READBACK_STEPS = 10  # captured steps run ahead of the host's reading of their loss (and progress bar)


@settings
class TrainSettings(CheckpointSettings, OptimizerSettings, BatchSettings, RunSettings, DataSettings):
    """Everything that defines a run (saved as run.json; `--resume` reads it back). The fields every
    training verb shares are declared in k3/train/settings.py; DEFAULTS holds this verb's values."""
    DEFAULTS: ClassVar[dict] = {
        "val_fraction": 0.02,  # the bundled corpus: 1 of 42 works
        "steps": 250, "eval_every": 100, "batch_size": 8, "seq_len": 256, "lr": 4e-3, "min_lr_ratio": 0.1,
        "weight_decay": 0.1, "ckpt_every": 100, "keep": 3}
    HELP: ClassVar[dict] = {
        "data": "a text file, a JSONL file with a 'text' field, or a folder of them (default: the bundled "
                "Shakespeare corpus)",
        "out": "run folder (default runs/<config>-<timestamp>)",
        "eval_every": "steps between evals and samples",
    }
    config: str = "k3-tiny"  # preset name or config.json path
    overrides: dict = dataclasses.field(default_factory=dict)  # K3Config fields to change, e.g. {"num_hidden_layers": 4}
    copy_share: float = 0.0  # share of the training bytes that are copy-shaped documents (k3.data.copy_corpus)
    weight_init: str = "zero-out"  # how a model from scratch starts: zero-out | normal (k3.train.init)
    eval_windows: int | None = None  # val windows per eval; None: all of val up to MAX_EVAL_TOKENS; same ones every eval
    sample_tokens: int = 80
    sample_prompts: tuple[str, ...] = ("To be, or not to be", "KING.\n")
    ep: int = 1  # expert-parallel ranks under torchrun (k3.parallel); the rest of the world is data parallel
    dp: int | None = None  # data-parallel ranks; None: world size / ep
    ep_plan: str = "balanced"  # balanced (MoonEP's online plan with expert copies) | home (plain EP)


def _check_writable(path: Path) -> None:
    """The nearest existing ancestor must be a writable folder (so mkdir cannot half-succeed)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise TrainError(f"output dir {path} is not writable: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise TrainError(f"output dir {path} is not writable: no write permission on {probe}")


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise TrainError(msg)


def validate_update(s) -> None:
    """The optimizer step's settings every training verb has: learning rate, decay, clipping."""
    _need(0 < s.lr < math.inf, f"learning rate must be a finite number > 0, got {s.lr}")
    _need(0 <= s.weight_decay < math.inf, f"weight decay must be a finite number >= 0, got {s.weight_decay}")
    # a clip <= 0 would zero (or, below 0, reverse) every gradient
    _need(0 < s.grad_clip <= math.inf, f"grad clip must be > 0 (inf: no clipping), got {s.grad_clip}")
    _need(0 <= s.min_lr_ratio <= 1, f"min lr ratio must be in [0, 1], got {s.min_lr_ratio}")


def validate_common(s, world_size: int, max_positions: int) -> None:
    """The checks every training verb's settings share (steps, batch, length, optimizer, outputs)."""
    _need(s.steps >= 1, f"steps must be >= 1, got {s.steps}")
    _need(s.batch_size >= 1 and s.grad_accum >= 1, "batch size and grad accumulation must be >= 1")
    _need(s.batch_size % (world_size * s.grad_accum) == 0,
          f"batch size {s.batch_size} must be divisible by world size {world_size} x grad accumulation {s.grad_accum}")
    _need(2 <= s.seq_len <= max_positions,
          f"sequence length {s.seq_len} is outside what the model takes: 2..{max_positions} (max_position_embeddings)")
    validate_update(s)
    _need(s.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {s.optimizer!r}")
    init = getattr(s, "weight_init", INITS[0])  # only verbs that build a model from scratch choose one
    _need(init in INITS, f"weight init must be one of {', '.join(INITS)}, got {init!r}")
    _need(s.balance in BALANCE_RULES, f"balance rule must be one of {', '.join(BALANCE_RULES)}, got {s.balance!r}")
    _need(s.keep >= 1 and s.ckpt_every >= 1 and s.eval_every >= 1, "keep, ckpt-every and eval-every must be >= 1")


def _validate(s: TrainSettings, world: World, max_positions: int, vocab_size: int) -> None:
    validate_common(s, world.size, max_positions)
    dp = world.size // s.ep if s.dp is None and s.ep >= 1 else s.dp
    _need(s.ep >= 1 and dp >= 1 and s.ep * dp == world.size,  # before anything is written
          f"--ep {s.ep} x --dp {dp} must equal the world size {world.size}")
    _need(s.eval_windows is None or s.eval_windows >= 1, f"eval windows must be >= 1, got {s.eval_windows}")
    _need(0.0 <= s.copy_share < 1.0, f"copy share must be in [0, 1), got {s.copy_share}")
    _need(isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size >= MIN_VOCAB_SIZE,
          f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (the byte-level BPE's special + 256 byte tokens), "
          f"got {vocab_size!r}")


# settings that name files or folders: run.json keeps them absolute, so `--resume` from another
# working directory reads the same files (a preset name stays a name)
PATH_SETTINGS = ("config", "data", "val_data", "cache_dir", "init", "teachers")


def run_record(settings) -> dict:
    """`settings` as run.json stores them."""
    return absolute_paths(dataclasses.asdict(settings))


def absolute_paths(record: dict) -> dict:
    """A settings dict with its PATH_SETTINGS that exist here made absolute (a copy)."""
    record = dict(record)

    def absolute(value):
        return str(Path(value).resolve()) if isinstance(value, str) and value and Path(value).exists() else value

    for key in PATH_SETTINGS:
        if key not in record or (key == "config" and record[key] in {**PRESETS, **VL_PRESETS}):
            continue
        value = record[key]
        record[key] = [absolute(v) for v in value] if isinstance(value, list) else absolute(value)
    return record


def model_config(config: str, overrides: dict) -> K3Config:
    """A preset or config.json with K3Config overrides, as a run resolves them (TrainError if bad)."""
    try:
        cfg = load_config(config)
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cfg)})
        if unknown:
            raise ConfigError(f"unknown K3Config fields in overrides: {unknown}")
        overrides = dict(overrides)
        if "num_hidden_layers" in overrides:  # re-derive K3's layer schedule for the new depth
            overrides.setdefault("kda_layers", [])
            overrides.setdefault("full_attn_layers", [])
        return cfg.replace(**overrides) if overrides else cfg
    except (ConfigError, FileNotFoundError, TypeError) as e:
        raise TrainError(str(e)) from None


class Trainer:
    SETTINGS = TrainSettings
    CHAT_MODEL = False  # its checkpoints carry the chat template (SFT, RL, VL: they learn conversations)
    OPTIONAL_STRINGS = ("data", "out", "cache_dir")  # settings that are None or a string
    OPTIONAL_FLOATS: tuple[str, ...] = ()  # settings that are None or a number
    OWN_GRAPH_STEP = False  # its own train_step runs the update through self.graphs (RL)

    def __init__(self, settings: TrainSettings, *, resume: bool = False, progress: bool = True, log=print):
        self._created = time.perf_counter()  # wall time counts setup too (tokenizer, tokenization)
        self.s = settings
        self.world = init_world(settings.device)
        self.progress = progress and self.world.is_main
        self.log = log if self.world.is_main else (lambda *a, **k: None)
        try:
            self._setup(settings, resume)
        except BaseException:
            shutdown(self.world)  # the process group started: leave no half-initialized job behind
            raise

    def _setup(self, settings: TrainSettings, resume: bool) -> None:
        config = self._read_config(settings)
        self._validate_settings(settings, config)
        self._prepare_run_dir(settings, resume)
        barrier(self.world)  # every rank has checked the run folder before rank 0 writes into it
        self._setup_data(settings, config, resume)
        self._write_run_files(settings, resume)
        torch.manual_seed(settings.seed)
        self._setup_model(init_for_training(self._new_model(), settings.weight_init), resume)

    def _validate_settings(self, settings: TrainSettings, config: K3Config) -> None:
        _validate(settings, self.world, config.max_position_embeddings, config.vocab_size)

    def _new_model(self) -> torch.nn.Module:
        """The model to train, freshly initialized (after the data set self.config's token ids)."""
        return K3ForCausalLM(self.config)

    def _read_config(self, settings) -> K3Config:
        return model_config(settings.config, settings.overrides)

    def _prepare_run_dir(self, settings, resume: bool) -> None:
        # rank 0's clock names a default folder: ranks started across a second boundary agree
        self.run_dir = Path(settings.out) if settings.out else Path("runs") / broadcast_object(
            f"{self.default_run_name(settings)}-{datetime.now():%Y%m%d-%H%M%S}", self.world)
        if resume:
            if not (self.run_dir / RUN_FILE).is_file():
                raise TrainError(f"cannot resume: {self.run_dir} has no {RUN_FILE}")
        else:
            _check_writable(self.run_dir)
            if self.run_dir.exists() and any(self.run_dir.iterdir()):
                raise TrainError(f"output dir {self.run_dir} already exists and is not empty (use --resume to continue it)")

    @staticmethod
    def default_run_name(settings) -> str:
        return Path(settings.config).stem

    def _setup_data(self, settings: TrainSettings, config: K3Config, resume: bool) -> None:
        train_docs, val_docs = split_documents(load_documents(settings.data), settings.val_fraction)
        # copy-shaped documents join the training split only: validation stays the corpus's own text
        train_docs = train_docs + copy_documents(train_docs, settings.copy_share, settings.seed)
        cache = self.cache_dir(settings)

        # tokenizer: the run's own on resume, else trained on the training split (cached)
        if resume:
            self.tokenizer = load_tokenizer(self.run_dir)
        else:
            tok_cache = cache / "tokenizers" / f"{tokenizer_fingerprint([d.text for d in train_docs], config.vocab_size)}.json"
            if tok_cache.is_file():
                self.tokenizer = load_tokenizer(tok_cache)
            else:
                self.log(f"training a {config.vocab_size}-token byte-level BPE on {len(train_docs)} documents ...")
                self.tokenizer = train_tokenizer([d.text for d in train_docs], config.vocab_size)
                tok_cache.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(tok_cache, lambda tmp: self.tokenizer.save(str(tmp)))  # ranks may race here
        self._adopt_tokenizer(config)
        ids = {"bos": self.config.bos_token_id, "eos": self.config.eos_token_id}
        self.log(f"tokenizing {len(train_docs)} train / {len(val_docs)} val documents ...")
        self.train_data = cached_token_stream(cache / "tokens", self.tokenizer, [d.text for d in train_docs], ids["bos"], ids["eos"])
        self.val_data = cached_token_stream(cache / "tokens", self.tokenizer, [d.text for d in val_docs], ids["bos"], ids["eos"])
        self.num_windows = self.train_data.num_windows(settings.seq_len)
        if self.num_windows < 1:
            raise TrainError(f"the training split has {len(self.train_data.tokens)} tokens, fewer than one "
                             f"sequence of {settings.seq_len}: use more data or a shorter --seq-len")

    @staticmethod
    def cache_dir(settings) -> Path:
        return resolve_cache_dir(settings.cache_dir)

    def _adopt_tokenizer(self, config: K3Config, keep_ids: bool = False) -> None:
        """self.config = `config` with the tokenizer's special ids (`keep_ids`: config.json's own, a
        release's, checked against its tokenizer when it was read); per-id byte counts for bits per byte."""
        if self.tokenizer.get_vocab_size() > config.vocab_size:
            raise TrainError(f"tokenizer has {self.tokenizer.get_vocab_size()} tokens, the model's vocab_size is {config.vocab_size}")
        if keep_ids:
            self.config = config
        else:
            try:
                ids = special_ids(self.tokenizer, ("bos", "eos", "pad"))  # pretraining needs no chat markers
            except ValueError as e:
                raise TrainError(str(e)) from None
            self.config = config.replace(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
        self.token_bytes = torch.tensor(token_bytes(self.tokenizer) + [0] * (config.vocab_size - self.tokenizer.get_vocab_size()))

    def _adopt_chat(self, start: ChatStart, config: K3Config) -> None:
        """A post-training verb's start (k3.train.chat_start): its tokenizer, fitted to `config`, and
        its chat format."""
        self.tokenizer, self.chat = start.tokenizer, start.chat
        self.tokenizer_files = start.files_from
        self._adopt_tokenizer(config, keep_ids=start.files_from is not None)

    def _write_run_files(self, settings, resume: bool) -> None:
        """Everything validated: from here on we write."""
        if self.world.is_main and not resume:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise TrainError(f"cannot create output dir {self.run_dir}: {e.strerror}") from None
            write_text_atomic(self.run_dir / RUN_FILE, json.dumps(run_record(settings), indent=2) + "\n")
            self.save_tokenizer_to(self.run_dir)
        self.metrics = MetricsLog(self.run_dir)

    def _setup_model(self, model: K3ForCausalLM, resume: bool) -> None:
        """Place, quantize, shard and compile `model`; build the optimizer; on resume load the latest checkpoint."""
        settings = self.s
        self.params = count_parameters(self.config)
        self.model = apply_transforms(model.to(self.world.device), settings, self.world)  # QAT, EP + FSDP2, compile
        self._start_optimizer(param_groups(self.model, self.config, weight_decay=settings.weight_decay,
                                           optimizer=settings.optimizer), resume)

    def _start_optimizer(self, groups: list[dict], resume: bool) -> None:
        """Per-Head Muon + AdamW over `groups`, the schedule, the counters and the balance rule; on
        resume the latest checkpoint."""
        settings = self.s
        refusal = self._graph_refusal()
        graphs = refusal is None
        self.optimizer = PerHeadMuon(groups, lr=settings.lr, weight_decay=settings.weight_decay, capturable=graphs)
        self.scheduler = warmup_cosine(self.optimizer, settings.steps, settings.min_lr_ratio)
        self.step, self.elapsed, self.tokens_seen = 0, 0.0, 0
        if resume:
            self._restore_latest()
        self.balance_rule = None if settings.balance == "none" else settings.balance
        self.balance_reduce = None
        if self.world.distributed and self.balance_rule is not None:
            if self.balance_rule == "quantile":  # exact QB needs every score: pool histograms instead
                self.balance_rule = "histogram"
                self.log("balance: quantile -> histogram QB pooled over ranks (DESIGN §6, within one bin of exact)")
            self.balance_reduce = lambda t: all_reduce_sum(t, self.world)
        self.graphs = None
        if graphs:
            self.graphs = GraphStep(self._graph_body, lambda: self.optimizer.zero_grad(set_to_none=True),
                                    device=self.world.device, pad_id=self.config.pad_token_id, log=self.log)
        elif getattr(settings, "cuda_graphs", False) and self.world.device.type == "cuda":
            self.log(f"cuda graphs: off ({refusal}); each step runs eagerly")

    def _graph_refusal(self) -> str | None:
        """Why this run cannot replay captured steps (None: it can)."""
        s = self.s
        checks = ((lambda: not getattr(s, "cuda_graphs", False), "--no-cuda-graphs"),
                  (lambda: self.world.device.type != "cuda", "not on CUDA"),
                  (lambda: type(self).train_step is not Trainer.train_step and not self.OWN_GRAPH_STEP,
                   f"{type(self).__name__} has its own step"),
                  (lambda: self.world.distributed, "under torchrun"),
                  (lambda: s.qat, "--qat"),
                  (lambda: self.graph_span() > MAX_GRAPH_SPAN,
                   f"attention spans over {MAX_GRAPH_SPAN:,} tokens: captured MLA attention is dense"))
        return next((why for bad, why in checks if bad()), None)

    def graph_span(self) -> int:
        """The most tokens a captured step's attention spans: a window, else a whole row."""
        return self.attention_segment() or self.s.batch_size // self.s.grad_accum * self.s.seq_len

    def _restore_latest(self) -> None:
        """Model, optimizer, scheduler and counters from the run's latest complete checkpoint."""
        found = latest_checkpoint(self.run_dir / "checkpoints")
        if found is not None:
            state = ckpt.load_checkpoint(found, self.model, self.optimizer, self.scheduler)
            self.step, self.elapsed, self.tokens_seen = state["step"], state["elapsed"], state["tokens_seen"]
            self.restore_state(state)
            self.log(f"resumed {self.run_dir} at step {self.step} from {found.name}")
        else:
            self.log(f"{self.run_dir} has no complete checkpoint: starting from step 0 with its saved settings")
        if self.world.is_main:
            self.metrics.truncate_after(self.step)

    @classmethod
    def from_run(cls, run_dir: str | Path, **kwargs) -> Trainer:
        path = Path(run_dir) / RUN_FILE
        if not path.is_file():
            raise TrainError(f"cannot resume: {run_dir} has no {RUN_FILE}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TrainError(f"cannot resume: {path} is not a readable run file ({e})") from None
        if not isinstance(raw, dict):
            raise TrainError(f"cannot resume: {path} is not a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls.SETTINGS)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise TrainError(f"cannot resume: {path} has unknown settings {unknown}")
        defaults = cls.SETTINGS()
        for name, value in raw.items():
            default = getattr(defaults, name)
            if name == "sample_prompts":
                ok = isinstance(value, list) and all(isinstance(p, str) for p in value)
            elif name in cls.OPTIONAL_STRINGS:
                ok = value is None or isinstance(value, str)
            elif name in cls.OPTIONAL_FLOATS:
                ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
            elif name in ("eval_windows", "dp"):
                ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
            elif isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))
            if not ok:
                raise TrainError(f"cannot resume: {path} has a bad value for {name}: {value!r}")
        if "sample_prompts" in raw:
            raw["sample_prompts"] = tuple(raw["sample_prompts"])
        settings = cls.SETTINGS(**{**raw, "out": str(run_dir)})
        return cls(settings, resume=True, **kwargs)

    # ------------------------------------------------------------------ one step
    def _autocast(self):
        # a captured step must not reuse weight casts cached at capture time: no cast cache
        bf16 = self.world.device.type == "cuda" and getattr(self.s, "precision", "bf16") == "bf16"
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=getattr(self, "graphs", None) is None)

    def _loss_sum(self, batch) -> torch.Tensor:
        with self._autocast():
            logits = self.model(batch.input_ids, cu_seqlens=batch.cu_seqlens)
        return F.cross_entropy(logits[0].float(), batch.labels[0], ignore_index=IGNORE_INDEX, reduction="sum")

    def step_items(self) -> tuple[list[int], int]:
        """The global batch of this step (item ids, ranks' shares in rank order) and its target count."""
        s = self.s
        windows = windows_for_step(self.num_windows, s.seed, self.step, s.batch_size)
        return windows, sum(int((window(self.train_data, i, s.seq_len)[1] != IGNORE_INDEX).sum()) for i in windows)

    def pack_items(self, items: list[int]):
        """One micro-batch: the items packed into one row with cu_seqlens."""
        return pack(self.train_data, items, self.s.seq_len)

    def global_tokens(self, local: int) -> int:
        """Tokens the step consumed over all ranks (windows: always the global batch's)."""
        return self.s.batch_size * self.s.seq_len

    def train_step(self) -> dict:
        if self.graphs is not None:
            return self._graph_train_step()
        s, world = self.s, self.world
        items, targets = self.step_items()
        per_rank = s.batch_size // world.size
        mine = items[world.rank * per_rank:(world.rank + 1) * per_rank]
        micro = per_rank // s.grad_accum
        self.model.train()
        nll = torch.zeros((), device=world.device)
        local_tokens = 0
        for j in range(s.grad_accum):
            batch = self.pack_items(mine[j * micro:(j + 1) * micro]).to(world.device)
            local_tokens += batch.input_ids.shape[1]
            loss_sum = self._loss_sum(batch)
            (loss_sum * (world.size / targets)).backward()
            nll += loss_sum.detach()
        grad_norm, lr, load = self.optimizer_step()
        step_tokens = self.global_tokens(local_tokens)
        self.tokens_seen += step_tokens
        return {"kind": "train", "step": self.step, "loss": float(all_reduce_sum(nll, world)) / targets, "lr": lr,
                "grad_norm": float(grad_norm), "tokens": self.tokens_seen, "max_load": round(float(load), 3),
                "step_tokens": step_tokens}

    def attention_segment(self) -> int | None:
        """Rows are whole windows of this many tokens, no document crossing one (None: no such
        promise): captured steps then attend window by window."""
        return self.s.seq_len

    def _graph_train_step(self) -> dict:
        """train_step through captured graphs: the record's `stats` (loss, grad norm, max load) stay on
        the device until the loop reads a few steps' back at once."""
        s = self.s
        items, targets = self.step_items()
        micro = s.batch_size // s.grad_accum
        batches = [self.pack_items(items[j * micro:(j + 1) * micro]) for j in range(s.grad_accum)]
        tokens = token_bucket(max(b.input_ids.shape[1] for b in batches))
        lr = self.scheduler.get_last_lr()[0]
        out = self.graphs.step(batches, 1.0 / targets, tokens=tokens, segment=self.attention_segment())
        stats = torch.stack([out.nll / targets, out.grad_norm, out.max_load])  # a copy the next replay keeps
        self.scheduler.step()
        self.step += 1
        step_tokens = self.global_tokens(sum(b.input_ids.shape[1] for b in batches))
        self.tokens_seen += step_tokens
        return {"kind": "train", "step": self.step, "stats": stats, "lr": lr, "tokens": self.tokens_seen,
                "step_tokens": step_tokens}

    def _graph_body(self, batches, scale: torch.Tensor) -> StepOutputs:
        """The step a graph captures: forward and backward of each micro-batch, clip, update, balance."""
        self.model.train()
        nll = torch.zeros((), device=self.world.device)
        for batch in batches:
            loss_sum = self._loss_sum(batch)
            (loss_sum * scale).backward()
            nll += loss_sum.detach()
        return StepOutputs(nll, *self._update(self.real_tokens(batches)))

    def real_tokens(self, batches) -> torch.Tensor:
        """[tokens of every row] bool: not a captured step's padding (pad ids only pad: no text
        encodes to the tokenizer's pad token), in the order the MoE gates record them."""
        return torch.cat([b.input_ids[0] != self.config.pad_token_id for b in batches])

    def _update(self, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, step the optimizer, apply the expert-balance rule (DESIGN §6) over the tokens
        `token_mask` keeps (default all). Returns the gradient norm and the step's largest expert
        load over its mean (0 without MoE layers), both on the device: nothing is read back here,
        so a captured step runs it too."""
        grad_norm = clip_grad_norm_(self.model.parameters(), self.s.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
        self.optimizer.step()
        loads = max_load(self.model, token_mask)  # before balance_step, which clears the loads
        balance_step(self.model, self.balance_rule, reduce_fn=self.balance_reduce, token_mask=token_mask)
        return grad_norm, loads.max() if loads is not None else torch.zeros_like(grad_norm)

    def optimizer_step(self) -> tuple[torch.Tensor, float, torch.Tensor]:
        """After the backward passes: the update (`_update`), then the schedule, and count the step.
        Returns the gradient norm, the step's learning rate and its largest expert load over the mean."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm, load = self._update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return grad_norm, lr, load

    # ------------------------------------------------------------------ eval and samples
    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None) -> dict:
        """Val loss (nats/token) and bits per byte over the first `max_windows` val windows (default:
        as many as MAX_EVAL_TOKENS holds). Every rank evaluates the same windows: FSDP's forward is a
        collective."""
        T = self.s.seq_len
        max_windows = self.s.eval_windows if max_windows is None else max_windows
        n = self.val_data.num_windows(T, partial=True)
        n = min(n, -(-MAX_EVAL_TOKENS // T) if max_windows is None else max_windows)
        per_batch = max(1, EVAL_ROW_TOKENS // T)
        self.model.eval()
        nats, tokens, nbytes = 0.0, 0, 0
        for start in range(0, n, per_batch):
            batch = pack(self.val_data, list(range(start, min(n, start + per_batch))), T).to(self.world.device)
            nats += float(self._loss_sum(batch))
            valid = batch.labels[0][batch.labels[0] != IGNORE_INDEX].cpu()
            tokens += valid.numel()
            nbytes += int(self.token_bytes[valid].sum())
        self.model.train()
        return {"kind": "eval", "step": self.step, "val_loss": nats / tokens,
                "val_bpb": nats / math.log(2) / max(nbytes, 1), "val_tokens": tokens, "val_bytes": nbytes}

    @torch.no_grad()
    def samples(self, temperature: float = 0.8, top_p: float = 0.95) -> list[dict]:
        bos = self.config.bos_token_id
        prompts = [[bos] + self.tokenizer.encode(p).ids for p in self.s.sample_prompts]
        self.model.eval()
        outs = generate(self.model, prompts, self.s.sample_tokens, temperature=temperature, top_p=top_p,
                        eos_token_id=self.config.eos_token_id, seed=self.s.seed)
        self.model.train()
        return [{"kind": "sample", "step": self.step, "prompt": p, "text": self.tokenizer.decode(o)}
                for p, o in zip(self.s.sample_prompts, outs)]

    def eval_line(self, ev: dict) -> str:
        """The progress line an eval record prints."""
        return (f"step {self.step}: val loss {ev['val_loss']:.4f}, val bpb {ev['val_bpb']:.4f} "
                f"({ev['val_tokens']:,} held-out tokens)")

    # ------------------------------------------------------------------ the loop
    def trainer_state(self) -> dict:
        """What a checkpoint's trainer_state.json holds besides the step and the schedule (JSON)."""
        return {"elapsed": self.elapsed, "tokens_seen": self.tokens_seen, "data_position": self.step * self.s.batch_size,
                "world_size": self.world.size, "settings": dataclasses.asdict(self.s)}

    def restore_state(self, state: dict) -> None:
        """Take back what `trainer_state` added (the counters are already restored)."""

    def _save(self) -> Path:
        return ckpt.save_checkpoint(self.run_dir / "checkpoints", self.step, self.model, self.optimizer,
                                    self.scheduler, self.trainer_state(), self.save_tokenizer_to, keep=self.s.keep,
                                    keep_all_state=self.s.keep_all_state)

    def _record(self, records: list[dict]) -> None:
        if self.world.is_main:
            for r in records:
                self.metrics.write(r)

    def train(self) -> dict:
        """Run to `steps`; returns the final eval record plus where things went."""
        s = self.s
        self.elapsed += time.perf_counter() - self._created
        bar = Progress(s.steps, self.step, log=self.log) if self.progress else None
        last_ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        pending: list[dict] = []  # steps whose device-side stats are not read back yet
        try:
            while self.step < s.steps:
                threads.adapt()  # yield CPU threads to other processes' load (k3/threads.py)
                if not pending:
                    t0 = time.perf_counter()
                pending.append(self.train_step())
                due = (len(pending) >= READBACK_STEPS or self.step % s.eval_every == 0
                       or self.step % s.ckpt_every == 0 or self.step == s.steps)
                if "stats" in pending[-1] and not due:
                    continue  # the host packs the next step while the card runs this one
                self._flush_steps(pending, t0, bar)
                pending = []
                if self.step % s.eval_every == 0 and self.step < s.steps:
                    t1 = time.perf_counter()
                    ev = self.evaluate()
                    self._record([ev, *self.samples()])
                    self.elapsed += time.perf_counter() - t1
                    if bar is not None:
                        bar.write(self.eval_line(ev))
                if self.step % s.ckpt_every == 0 or self.step == s.steps:
                    t1 = time.perf_counter()
                    last_ckpt = self._save()
                    self.elapsed += time.perf_counter() - t1
        finally:
            if bar is not None:
                bar.close()
        t1 = time.perf_counter()
        final = self.evaluate()
        samples = self.samples()
        self.elapsed += time.perf_counter() - t1
        if self.world.is_main:
            records = [r for r in self.metrics.read() if not (r["step"] == self.step and r["kind"] != "train")]
            records += [final, *samples]
            self.metrics.rewrite(records)
            self.write_outputs(records, last_ckpt)
        return {**final, "run_dir": str(self.run_dir), "checkpoint": str(last_ckpt), "samples": samples,
                "elapsed": self.elapsed}

    def _flush_steps(self, records: list[dict], t0: float, bar) -> None:
        """Record steps (and the progress bar): graph steps' device stats are read back in one go;
        the window's time since `t0` is shared out by tokens."""
        stats = [r.pop("stats") for r in records if "stats" in r]
        if stats:
            values = torch.stack(stats).tolist()  # the one host sync of the window
            for r, (loss, grad_norm, load) in zip(records, values):
                r.update(loss=loss, grad_norm=grad_norm, max_load=round(load, 3))
        dt = time.perf_counter() - t0
        tokens = sum(r["step_tokens"] for r in records)
        for r in records:
            step_dt = dt * r.pop("step_tokens") / max(tokens, 1)
            self.elapsed += step_dt
            r.update(tok_per_s=round(tokens / dt), elapsed=round(self.elapsed, 2))
        self._record(records)
        if bar is not None:
            bar.update(self.step, records[-1])

    def save_tokenizer_to(self, folder: Path) -> None:
        """The run's tokenizer, with the chat template when the trainer teaches chat (CHAT_MODEL):
        the mark `k3 chat` and `k3 serve` read as a chat model. A release's tokenizer files (and its
        chat template) are carried over as they came, so its own code reads the checkpoint too."""
        from k3.text.chat_template import CHAT_TEMPLATE
        from k3.text.model_folder import carry_tokenizer_files

        if getattr(self, "tokenizer_files", None) is not None:
            carry_tokenizer_files(self.tokenizer_files, folder)
            return
        save_tokenizer(self.tokenizer, folder, chat_template=CHAT_TEMPLATE if self.CHAT_MODEL else None)

    def write_outputs(self, records: list[dict], checkpoint: Path | None) -> None:
        """loss.png and report.md from the run's final records (rank 0)."""
        plot_losses(records, self.run_dir / PLOT_FILE,
                    title=f"{self.run_dir.name}: {self.params['total'] / 1e6:.1f}M-parameter {Path(self.s.config).stem}")
        write_report(self.run_dir / REPORT_FILE, settings=dataclasses.asdict(self.s), params=self.params,
                     records=records, wall_time_s=self.elapsed, checkpoint=checkpoint)

    def close(self) -> None:
        shutdown(self.world)
