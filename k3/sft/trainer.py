"""Supervised fine-tuning in K3's XTML chat format (`k3 sft`), on the pretraining Trainer's machinery.

The run starts from a checkpoint (a `k3 train` run's latest, or any checkpoint folder) and its
tokenizer, which must hold K3's four chat markers. Each conversation is rendered once by the one
XTML renderer; the loss is the mean next-token cross-entropy over the assistant tokens of the global
batch (k3/sft/batches.py), so system, user, tool-declaration and tool-result tokens are context only.
Everything else is `k3 train`'s: Per-Head Muon + AdamW, warmup-cosine, the expert-balance rule,
optional MXFP4/MXFP8 QAT (DESIGN §13.4: QAT is on from SFT on in K3), FSDP2 under torchrun, atomic
checkpoints with exact resume, metrics.jsonl, loss.png and report.md. At the end, held-out agent
episodes are run (k3/tasks/episodes.py) and scored (k3/tasks/scoring.py) when the held-out set carries
expected answers.
The checkpoint's tokenizer_config.json gets a `chat_template`, which marks the model chat-tuned for
`k3 serve` and `k3 chat`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from k3.checkpoint.files import CheckpointError, read_json
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import latest_checkpoint, resolve_checkpoint
from k3.config import K3Config
from k3.model.transformer import K3ForCausalLM
from k3.sft.batches import example, pack_examples, rows_of
from k3.tasks import default_set
from k3.tasks.conversations import SFTDataError, check_length, read_conversations
from k3.tasks.episodes import run_episodes
from k3.tasks.scoring import ConversationTask, summarize_episodes
from k3.train.chat_start import load_chat_start
from k3.train.errors import TrainError
from k3.train.metrics import PLOT_FILE, REPORT_FILE, plot_losses, write_report
from k3.train.packing import IGNORE_INDEX, windows_for_step
from k3.train.parallel import all_reduce_sum
from k3.train.prefix_tree import first_targets, tail_logits
from k3.train.settings import (
    BatchSettings,
    CheckpointSettings,
    DataSettings,
    OptimizerSettings,
    RunSettings,
    StartSettings,
    settings,
)
from k3.train.trainer import EVAL_ROW_TOKENS, Trainer, validate_common

AGENT_FILE = "agent_eval.jsonl"


@settings
class SFTSettings(CheckpointSettings, OptimizerSettings, BatchSettings, RunSettings, DataSettings, StartSettings):
    """Everything that defines an SFT run (saved as run.json; `--resume` reads it back). The fields
    every training verb shares are declared in k3/train/settings.py; DEFAULTS holds this verb's values."""
    DEFAULTS: ClassVar[dict] = {
        "val_fraction": 0.05,
        "steps": 100,  # with k3 train's default run, the two take ~11 of the 15 minutes on 2 CPU cores
        "eval_every": 50, "batch_size": 8,
        "seq_len": 1024,  # the longest conversation, in tokens; a longer one is an error naming its line
        "lr": 2e-3, "min_lr_ratio": 0.1, "weight_decay": 0.0, "ckpt_every": 20, "keep": 2}
    HELP: ClassVar[dict] = {
        "init": "start from this `k3 train` run's latest checkpoint",
        "data": 'JSONL of OpenAI-style conversations: {"messages": [...], "tools": [...]} per line '
                "(default: the embedded default SFT set)",
        "val_fraction": "share of --data's conversations held out when there is no --val-data",
        "out": "run folder (default runs/sft-<init>-<timestamp>)",
        "eval_every": "steps between held-out evals",
        "batch_size": "conversations per optimizer step, all ranks together",
        "seq_len": "the longest conversation in tokens; longer is an error",
    }
    val_data: str | None = None  # held-out JSONL; None: the default set's held-out split, or val_fraction of `data`
    train_size: int = 800  # conversations drawn from the default set (train split): one epoch by default
    val_size: int = 64  # held-out conversations of the default set (loss and agent episodes)
    share_prefixes: bool = True  # tokens before each conversation's first target run once per distinct prefix
    agent_episodes: int = 64  # held-out episodes scored at the end (0: none)
    max_reply_tokens: int = 160


def _validate(s: SFTSettings, world_size: int, max_positions: int) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise TrainError(msg)

    need(bool(s.init), "an initial checkpoint is required: --run RUN_DIR or --model CHECKPOINT_DIR")
    validate_common(s, world_size, max_positions)
    need(s.train_size >= 1 and s.val_size >= 1, "train and val sizes must be >= 1")
    need(0 < s.val_fraction < 1, f"val fraction must be in (0, 1), got {s.val_fraction}")
    need(s.agent_episodes >= 0 and s.max_reply_tokens >= 1, "agent episodes must be >= 0, max reply tokens >= 1")


class SFTTrainer(Trainer):
    SETTINGS = SFTSettings
    CHAT_MODEL = True
    OPTIONAL_STRINGS = ("data", "val_data", "out", "cache_dir")

    @staticmethod
    def default_run_name(settings) -> str:
        return f"sft-{Path(settings.init).name}"

    def _setup(self, settings: SFTSettings, resume: bool) -> None:
        self._prepare_run_dir(settings, resume)
        own = latest_checkpoint(self.run_dir / "checkpoints") if resume else None
        try:
            if own is not None:  # resume: _setup_model loads the run's own checkpoint into it, once
                source = own
                model = K3ForCausalLM(K3Config.from_dict(read_json(own / "config.json")))
            else:
                source = resolve_checkpoint(settings.init)
                model = load_pretrained(source)
        except (FileNotFoundError, CheckpointError, ValueError) as e:
            raise TrainError(f"cannot load the initial checkpoint: {e}") from None
        _validate(settings, self.world.size, model.config.max_position_embeddings)
        self._adopt_chat(load_chat_start(model.config, self.run_dir if resume else source, settings.init, "k3 sft",
                                         source, "SFT needs a tokenizer trained with K3's chat markers"), model.config)
        self._setup_conversations(settings)
        self._write_run_files(settings, resume)
        self._setup_model(model, resume)

    def _render(self, conversations) -> list:
        out = []
        for c in conversations:
            try:
                r = self.chat.render(c.messages, tools=c.tools, reasoning_effort=c.reasoning_effort,
                                     add_generation_prompt=False)
            except ValueError as e:
                raise SFTDataError(f"{c.where}: {e}") from None
            check_length(c, len(r.token_ids), self.s.seq_len)
            if not any(r.loss_mask[1:]):
                raise SFTDataError(f"{c.where}: no assistant tokens to learn")
            out.append(example(r.token_ids, r.loss_mask, c.line))
        return out

    def _setup_conversations(self, s: SFTSettings) -> None:
        if s.data is None:
            train = default_set.load("train", s.train_size, s.seed)
            held = default_set.load("heldout", s.val_size, s.seed)
        else:
            train = read_conversations(s.data)
            held = read_conversations(s.val_data) if s.val_data is not None else []
        self.log(f"rendering {len(train) + len(held)} conversations ...")
        train_examples, val_examples = self._render(train), self._render(held)  # every line checked first
        if s.data is not None and s.val_data is None:  # every k-th conversation: deterministic, spread out
            k = max(2, min(round(1 / s.val_fraction), len(train)))
            held = train[k - 1::k]
            val_examples = val_examples + train_examples[k - 1::k]
            train = [c for i, c in enumerate(train) if i % k != k - 1]
            train_examples = [e for i, e in enumerate(train_examples) if i % k != k - 1]
        if not train_examples or not val_examples:
            raise SFTDataError(f"{s.data}: too few conversations to hold some out "
                               f"(train {len(train_examples)}, held-out {len(val_examples)})")
        self.train_examples, self.val_examples = train_examples, val_examples
        self.held_tasks = [ConversationTask(c) for c in held if c.expected is not None][:s.agent_episodes]

    # ------------------------------------------------------------------ one step
    def step_items(self) -> tuple[list[int], int]:
        chosen = windows_for_step(len(self.train_examples), self.s.seed, self.step, self.s.batch_size)
        return chosen, sum(self.train_examples[i].targets for i in chosen)

    def pack_items(self, items: list[int]):
        return pack_examples([self.train_examples[i] for i in items])

    def attention_segment(self) -> int | None:
        """None: conversations are packed end to end, not in fixed windows."""
        return None

    def global_tokens(self, local: int) -> int:
        """Conversations differ in length, so ranks count theirs and add them up."""
        if not self.world.distributed:  # no device round trip: a captured step must not wait on it
            return local
        return int(all_reduce_sum(torch.tensor(float(local), device=self.world.device), self.world))

    def _loss_sum(self, batch) -> torch.Tensor:
        """Summed NLL of the assistant targets. With `share_prefixes` (not under --compile, whose
        regions are traced for whole rows, nor in captured steps, whose rows have fixed shapes),
        the tokens before each conversation's first target, the system messages most conversations
        repeat, run once per distinct prefix (k3/train/prefix_tree.py): the same loss and gradient."""
        if self.s.share_prefixes and not self.s.compile and self.graphs is None:
            labels = batch.labels[0]
            firsts = first_targets(labels != IGNORE_INDEX, batch.cu_seqlens)
            if firsts is not None:
                with self._autocast():
                    logits = tail_logits(self.model, batch.input_ids, batch.cu_seqlens, firsts)
                if logits is not None:
                    ends = batch.cu_seqlens.tolist()[1:]
                    tails = torch.cat([labels[f:e] for f, e in zip(firsts, ends)])
                    return F.cross_entropy(logits.float(), tails, ignore_index=IGNORE_INDEX, reduction="sum")
        return super()._loss_sum(batch)

    # ------------------------------------------------------------------ eval and samples
    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None) -> dict:
        """Loss over the held-out conversations' assistant tokens (nats/token) and bits per byte of them."""
        self.model.eval()
        nats, tokens, nbytes = 0.0, 0, 0
        for row in rows_of(self.val_examples, EVAL_ROW_TOKENS):
            batch = pack_examples(row).to(self.world.device)
            nats += float(self._loss_sum(batch))
            valid = batch.labels[0][batch.labels[0] != IGNORE_INDEX].cpu()
            tokens += valid.numel()
            nbytes += int(self.token_bytes[valid].sum())
        self.model.train()
        return {"kind": "eval", "step": self.step, "val_loss": nats / max(tokens, 1),
                "val_bpb": nats / math.log(2) / max(nbytes, 1), "val_tokens": tokens, "val_bytes": nbytes}

    @torch.no_grad()
    def samples(self, temperature: float = 0.0, top_p: float = 1.0) -> list[dict]:
        """Greedy replies to the first two held-out prompts, shown with their XTML markers."""
        # run_episodes generates in eval mode: a training-mode forward records router scores, which the
        # next step's Quantile Balancing update would count (and a resumed run would not have seen)
        episodes = run_episodes(self.model, self.chat, self.held_tasks[:2], None, self.s.max_reply_tokens, max_turns=1)
        return [{"kind": "sample", "step": self.step, "prompt": e.task.messages[-1].get("content") or "",
                 "text": "\n" + self.tokenizer.decode(e.turns[0], skip_special_tokens=False)} for e in episodes]

    # ------------------------------------------------------------------ outputs
    def train(self) -> dict:
        result = super().train()
        if self.held_tasks and self.world.is_main:
            t0 = time.perf_counter()
            self.log(f"scoring {len(self.held_tasks)} held-out agent episodes ...")
            played = run_episodes(self.model, self.chat, self.held_tasks, None, self.s.max_reply_tokens)
            summary, episodes = summarize_episodes(played, self.tokenizer)
            self.elapsed += time.perf_counter() - t0
            record = {"kind": "agent", "step": self.step, "episodes": len(episodes), **summary}
            self.metrics.write(record)
            (self.run_dir / AGENT_FILE).write_text("".join(json.dumps(e) + "\n" for e in episodes))
            self.write_outputs(self.metrics.read(), Path(result["checkpoint"]))
            result["agent"] = record
        result["elapsed"] = self.elapsed
        return result

    def write_outputs(self, records: list[dict], checkpoint: Path | None) -> None:
        s = self.s
        plot_losses(records, self.run_dir / PLOT_FILE,
                    title=f"{self.run_dir.name}: SFT of {self.params['total'] / 1e6:.1f}M parameters")
        agent = [r for r in records if r["kind"] == "agent"]
        extra = []
        if agent:
            a = agent[-1]
            extra = ["## Held-out agent episodes", "", "| | |", "|---|---|",
                     *(f"| {k.replace('_', ' ')} | {a[k]:.1%} |" for k in a if isinstance(a[k], float)),
                     f"| episodes | {a['episodes']} (each: `{AGENT_FILE}`) |", ""]
        write_report(self.run_dir / REPORT_FILE, settings=dataclasses.asdict(s), params=self.params, records=records,
                     wall_time_s=self.elapsed, checkpoint=checkpoint, title="k3 SFT run",
                     model=f"SFT of `{self.s.init}`",
                     data=s.data or f"embedded default SFT set ({s.train_size} train / {s.val_size} held-out)",
                     batch=f"{s.batch_size} conversations (of at most {s.seq_len} tokens)", extra=extra)

