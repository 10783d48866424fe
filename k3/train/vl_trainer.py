"""Joint vision-language training from scratch (`k3 train --config k3-tiny-vl`, DESIGN §7).

K3ForConditionalGeneration (k3/model/multimodal.py: MoonViT-V2 tower + patchmergerv2 projector +
the K3 text model) trains on a mix of the bundled text and generated scenes with questions
(k3/data/shapes_corpus.py) as K3 chat conversations, in the XTML form `/v1/chat/completions` renders
(k3/train/vl_data.py): each step packs `batch_size` text windows and `vl_scenes` VL documents into
one row with cu_seqlens, the images' rows written over their placeholder tokens. The loss is the
mean next-token NLL over the text windows' targets plus `vl_loss_weight` times the mean over the VL
documents' assistant replies of each reply's summed NLL (its answer and closing markers): two means,
so the few replies are not drowned by the many text tokens, and the markers, learned in a few steps,
do not dilute the answers; both are recorded (`text_loss`, `image_loss`, nats per reply) and
plotted apart.
Everything else is `k3 train`'s: Per-Head Muon + AdamW over every parameter, tower and projector
included (`vl_param_groups`), warmup-cosine, the expert-balance rule, atomic checkpoints with exact
resume (the data of a step is a pure function of (seed, step)), metrics.jsonl, loss.png, report.md,
and FSDP2 under torchrun (`shard_multimodal`; each rank its share of the step's windows and scenes).
The checkpoint folder is the published multimodal layout (`language_model.*`, `vision_tower.*`,
`mm_projector.*`), which `k3.checkpoint.multimodal.load_pretrained_multimodal` reads.

Evaluation: text val loss / bits per byte as `k3 train`, the reply loss on held-out questions of the
corpus, and their accuracy, by question type: each question is the chat prompt the server renders
for a one-image request (`VLEncoder.prompt`), the reply greedy until `<|end_of_msg|>` or eos and
parsed by the server's parser (k3/text/xtml.py), its content exact-matched after strip. At the end
two text-only baselines on the same questions: the corpus's majority answer per question, and this
model with every image replaced by a blank canvas.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import ClassVar

import torch
from PIL import Image
from tokenizers import AddedToken
from torch.nn import functional as F

from k3.atomic import write_atomic
from k3.config import ConfigError
from k3.data import shapes_corpus as corpus
from k3.data.corpus import load_documents, split_documents
from k3.generation.generate import generate
from k3.media.image_processor import ImageProcessor
from k3.model.cache import K3Cache
from k3.model.multimodal import K3ForConditionalGeneration, K3MultimodalConfig
from k3.model.params import count_parameters, count_vision_parameters
from k3.text.tokenizer import load_tokenizer, tokenizer_fingerprint, train_tokenizer
from k3.train.errors import TrainError
from k3.train.graph_step import padded_docs, token_bucket
from k3.train.metrics import PLOT_FILE, REPORT_FILE, write_report
from k3.train.muon import OPTIMIZERS, Blocks, param_groups
from k3.train.packing import IGNORE_INDEX, cached_token_stream, window, windows_for_step
from k3.train.parallel import all_reduce_sum, any_rank
from k3.train.settings import settings
from k3.train.trainer import MAX_GRAPH_SPAN, Trainer, TrainSettings, validate_common
from k3.train.transforms import apply_transforms
from k3.train.vl_config import VLCheckpointConfig, load_vl_config
from k3.train.vl_data import VLEncoder, corpus_texts, describe, pack_vl, scene_questions, scenes_for_step
from k3.train.vl_graph import VLGraphRow, pad_vl_batch

VQA_CHUNK = 64  # held-out prompts per prefill
TOKENIZER_SCENES = 400  # scenes whose question/answer text joins the tokenizer's training text


@settings
class VLSettings(TrainSettings):
    """A `k3 train` run of a VL model (saved as run.json; `--resume` reads it back). The defaults
    fit the 15-minute budget of the default run on 2 CPU cores (docs/VISION.md, Joint training)."""
    DEFAULTS: ClassVar[dict] = {
        "config": "k3-tiny-vl", "steps": 560,
        "batch_size": 2,  # text windows per step (about a sixth of the row: the VL answers are the hard part)
        "seq_len": 160,  # as long as a VL document: the chunked KDA pads every segment of a row to the longest
        "eval_every": 280,  # a held-out eval prefills 400 chat prompts and decodes each reply's markers
        "eval_windows": 16}
    vl_scenes: int = 11  # VL documents (scenes) per step: 4-turn conversations of about 145 tokens
    vl_questions: int = 4  # questions per scene: chat turns, each answer learned
    # without the think channel: 44 answers a step instead of 16, and `k3 serve --run` renders requests
    # the same way (run.json); with it, 560 steps of 4 scenes did not learn to read images (docs/VISION.md)
    vl_thinking: bool = False
    image_size: int = 84  # 6 x 6 patches of 14: each cell of the corpus's 3 x 3 grid is one merged row
    vl_describe: bool = False  # end each VL document with the scene's cell-by-cell description, learned
    vl_loss_weight: float = 1.0
    vision_lr_scale: float = 1.0  # the tower's and projector's learning rate, relative to `lr`
    vision_optimizer: str = ""  # the tower's and projector's matrices: "" = as `optimizer`, else one of OPTIMIZERS
    vqa_eval: int = 400  # held-out questions scored at each eval
    max_answer_tokens: int = 6  # of a reply's content; the reply's markers come on top
    baseline_examples: int = 2000  # training examples the majority baseline counts


def _validate_vl(s: VLSettings, config: K3MultimodalConfig, world_size: int = 1) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise TrainError(msg)

    validate_common(s, world_size, config.text_config.max_position_embeddings)
    need(s.eval_windows is None or s.eval_windows >= 1, f"eval windows must be >= 1, got {s.eval_windows}")
    need(s.copy_share == 0, "--copy-share applies to text runs, not VL runs")
    need(s.ep == 1, "--ep applies to text runs: VL runs shard with FSDP only (every rank holds all experts)")
    need(s.vl_scenes >= 0 and s.vl_scenes % (world_size * s.grad_accum) == 0,
         f"VL scenes per step (--vl-scenes) must be >= 0 and divisible by world size {world_size} x grad accumulation "
         f"{s.grad_accum}, got {s.vl_scenes}")
    need(s.vl_questions >= 1, f"questions per scene must be >= 1, got {s.vl_questions}")
    # an upper bound too: a canvas of 100,000 px is tens of GB before the processor's own budget applies
    need(42 <= s.image_size <= 1024, f"image size must be 42..1024 px (the corpus's 3 x 3 grid), got {s.image_size}")
    need(s.vl_loss_weight >= 0, f"VL loss weight must be >= 0, got {s.vl_loss_weight}")
    need(s.vqa_eval >= 1 and s.max_answer_tokens >= 1 and s.baseline_examples >= 1,
         "held-out questions, max answer tokens and baseline examples must be >= 1")
    need(s.vision_optimizer in ("", *OPTIMIZERS),
         f"vision optimizer must be empty (as the optimizer) or one of {', '.join(OPTIMIZERS)}, got {s.vision_optimizer!r}")
    need(s.vision_lr_scale > 0, f"vision learning-rate scale must be > 0, got {s.vision_lr_scale}")
    need(not config.text_config.tie_word_embeddings, "VL training needs untied embeddings (tie_word_embeddings false)")


# ---------------------------------------------------------------------- optimizer groups
def vision_blocks(name: str, param: torch.Tensor, head_dim: int) -> Blocks | None:
    """The Muon block structure of a vision-encoder parameter, or None for AdamW (DESIGN §8). The
    tower's attention is multi-head like the LM's, so Per-Head Muon cuts it the same way: wqkv's rows
    are [q | k | v] x heads x head_dim (3 * heads row blocks), wo's columns are heads x head_dim.
    The patch convolution [D, 3, P, P] is the image analogue of the token embedding and the position
    table [H0, W0, D] of a position embedding: AdamW, as embeddings; norms too."""
    if param.dim() != 2:
        return None
    if name.endswith(".wqkv.weight"):
        return Blocks(0, head_dim)
    if name.endswith(".wo.weight"):
        return Blocks(1, head_dim)
    return Blocks()  # MLP fc0/fc1 and the projector's two matrices: whole


def vl_param_groups(model: K3ForConditionalGeneration, *, weight_decay: float, optimizer: str = "per-head-muon",
                    vision_optimizer: str | None = None, vision_lr: float | None = None) -> list[dict]:
    """k3.train.muon.param_groups for the text model (its names prefixed `language_model.`) plus the
    vision tower's and projector's own groups (`vision_muon_*`, `vision_adamw_*`) under the same
    rules, or `vision_optimizer`'s, at `vision_lr` when given (else the optimizer's lr)."""
    groups = param_groups(model.language_model, model.config.text_config, weight_decay=weight_decay,
                          optimizer=optimizer)
    for g in groups:
        g["param_names"] = ["language_model." + n for n in g["param_names"]]
    head_dim = model.config.vision_config.head_dim
    optimizer = vision_optimizer or optimizer
    vision: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if name.startswith("language_model.") or not p.requires_grad:
            continue
        blocks = None if optimizer == "adamw" else vision_blocks(name, p, head_dim)
        if blocks is not None and optimizer == "muon":
            blocks = Blocks()
        if blocks is not None:
            key = f"vision_muon_{blocks.label}"
            extra = {"kind": "muon", "block_axis": blocks.axis, "block_size": blocks.size, "weight_decay": weight_decay}
        elif p.dim() >= 2:
            key, extra = "vision_adamw_decay", {"kind": "adamw", "weight_decay": weight_decay}
        else:
            key, extra = "vision_adamw_no_decay", {"kind": "adamw", "weight_decay": 0.0}
        if vision_lr is not None:
            extra["lr"] = vision_lr
        g = vision.setdefault(key, {"name": key, "params": [], "param_names": [], **extra})
        g["params"].append(p)
        g["param_names"].append(name)
    groups += vision.values()
    return sorted(groups, key=lambda g: g["name"])


# ---------------------------------------------------------------------- the trainer
class VLTrainer(Trainer):
    SETTINGS = VLSettings
    CHAT_MODEL = True  # it learns chat conversations: `k3 chat` / `k3 serve` take it as a chat model
    OWN_GRAPH_STEP = True  # train_step replays its step through self.graphs (DESIGN §14.5)

    def _validate_settings(self, settings: VLSettings, config: K3MultimodalConfig) -> None:
        _validate_vl(settings, config, self.world.size)

    def _new_model(self) -> K3ForConditionalGeneration:
        return K3ForConditionalGeneration(self.mm_config)

    def _read_config(self, settings) -> K3MultimodalConfig:
        try:
            return load_vl_config(settings.config, settings.overrides)
        except (ConfigError, FileNotFoundError, TypeError, ValueError) as e:
            raise TrainError(str(e)) from None

    def _tokenizer(self, settings: VLSettings, texts: list[str], vocab_size: int, resume: bool):
        """The run's own on resume; else a byte-level BPE (with K3's chat markers, as every k3
        tokenizer) on the text split and the text of the corpus's chat conversations, one id short of
        the vocabulary, then the image placeholder as a special token at the end (the id the model's
        media_placeholder_token_id names)."""
        if resume:
            return load_tokenizer(self.run_dir)
        texts = texts + corpus_texts(0, TOKENIZER_SCENES, settings.image_size)
        key = tokenizer_fingerprint(texts + [corpus.IMAGE_PLACEHOLDER], vocab_size - 1)
        path = self.cache_dir(settings) / "tokenizers" / f"vl-{key}.json"
        if path.is_file():
            return load_tokenizer(path)
        self.log(f"training a {vocab_size}-token byte-level BPE (with {corpus.IMAGE_PLACEHOLDER}) "
                 f"on {len(texts)} documents ...")
        tok = train_tokenizer(texts, vocab_size - 1)
        tok.add_special_tokens([AddedToken(corpus.IMAGE_PLACEHOLDER, special=True, normalized=False)])
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: tok.save(str(tmp)))
        return tok

    def _setup_data(self, settings: VLSettings, config: K3MultimodalConfig, resume: bool) -> None:
        train_docs, val_docs = split_documents(load_documents(settings.data), settings.val_fraction)
        self.tokenizer = self._tokenizer(settings, [d.text for d in train_docs], config.text_config.vocab_size, resume)
        placeholder = self.tokenizer.token_to_id(corpus.IMAGE_PLACEHOLDER)
        if placeholder is None:
            raise TrainError(f"the run's tokenizer has no {corpus.IMAGE_PLACEHOLDER} token")
        self._adopt_tokenizer(config.text_config)
        self.token_bytes[placeholder] = 0  # a special token: no text bytes
        self.mm_config = VLCheckpointConfig(self.config, config.vision_config, media_placeholder_token_id=placeholder)
        cache = self.cache_dir(settings) / "tokens"
        bos, eos = self.config.bos_token_id, self.config.eos_token_id
        self.log(f"tokenizing {len(train_docs)} train / {len(val_docs)} val documents ...")
        self.train_data = cached_token_stream(cache, self.tokenizer, [d.text for d in train_docs], bos, eos)
        self.val_data = cached_token_stream(cache, self.tokenizer, [d.text for d in val_docs], bos, eos)
        self.num_windows = self.train_data.num_windows(settings.seq_len)
        if self.num_windows < 1:
            raise TrainError(f"the training split has {len(self.train_data.tokens)} tokens, fewer than one "
                             f"sequence of {settings.seq_len}: use more data or a shorter --seq-len")
        processor = ImageProcessor.from_vision_config(config.vision_config)
        try:
            self.encoder = VLEncoder(self.tokenizer, processor, placeholder, thinking=settings.vl_thinking)
        except ValueError as e:  # a tokenizer without K3's chat markers
            raise TrainError(f"the run's tokenizer cannot render chat: {e}") from None
        self.heldout = list(corpus.examples("heldout", settings.vqa_eval, settings.seed, size=settings.image_size))
        self._last_answers: list[str] = []

    def _setup_model(self, model: K3ForConditionalGeneration, resume: bool) -> None:
        """As Trainer's: placed, quantized, sharded under torchrun (FSDP2 over the tower's blocks
        and the text model's layers, k3/train/parallel.py), compiled; the wrapper's groups, and the
        checkpoint of the run on resume."""
        s = self.s
        model = apply_transforms(model.to(self.world.device), s, self.world)  # QAT, FSDP2, compile (DESIGN §14.3)
        self.params = count_parameters(self.config)
        self.vision_params = count_vision_parameters(self.mm_config.vision_config)
        self.model = model
        self._start_optimizer(vl_param_groups(model, weight_decay=s.weight_decay, optimizer=s.optimizer,
                                              vision_optimizer=s.vision_optimizer or None,
                                              vision_lr=s.lr * s.vision_lr_scale), resume)

    # ------------------------------------------------------------------ one step
    def step_items(self) -> tuple[list[int], list[int]]:
        """The step's text windows and scene indices (pure functions of (seed, step)), all ranks'."""
        s = self.s
        return windows_for_step(self.num_windows, s.seed, self.step, s.batch_size), list(scenes_for_step(self.step, s.vl_scenes))

    def rank_items(self) -> tuple[list[int], list[int]]:
        """This rank's contiguous share of the step's windows and scenes: the ranks together see the
        one-process step, so the global batch does not depend on the world size."""
        (windows, scenes), world = self.step_items(), self.world
        w, d = len(windows) // world.size, len(scenes) // world.size
        return windows[world.rank * w:(world.rank + 1) * w], scenes[world.rank * d:(world.rank + 1) * d]

    def documents(self, scenes: list[int]) -> list:
        s = self.s
        docs = []
        for i in scenes:
            scene, qas = scene_questions(s.seed, i, s.vl_questions, s.image_size)
            docs.append(self.encoder.document(scene.image, qas, describe(scene) if s.vl_describe else None))
        return docs

    def _loss_sums(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed NLL over the text targets and over the VL targets of one packed row. Logits only
        at the targets: most of a VL document (image, question, prompt markers) is context, and the
        LM head over every position was a tenth of a step."""
        labels = batch.labels[0]
        keep = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        with self._autocast():
            logits = self.model(batch.input_ids, batch.pixel_values, batch.grid_thws, cu_seqlens=batch.cu_seqlens,
                                logits_to_keep=keep)
        nll = F.cross_entropy(logits[0].float(), labels[keep], reduction="none")
        is_vl = batch.is_vl[0][keep]
        return nll[~is_vl].sum(), nll[is_vl].sum()

    def train_step(self) -> dict:
        s, world, device = self.s, self.world, self.world.device
        windows, scenes = self.rank_items()
        docs = self.documents(scenes)
        if self.graphs is not None:
            record = self._graph_train_step_vl(windows, docs)
            if record is not None:
                return record
            self.optimizer.zero_grad(set_to_none=True)  # a replayed step leaves its gradients set
        # the step's normalizers over all ranks (each rank renders its own documents only)
        counts = torch.tensor(self._targets(windows, docs), dtype=torch.float64, device=device)
        text_targets, vl_answers = (max(int(c), 1) for c in all_reduce_sum(counts, world).tolist())
        self.model.train()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # text NLL, VL NLL, tokens
        for batch in self._micro_batches(windows, docs):
            batch = batch.to(device)
            text_sum, vl_sum = self._loss_sums(batch)
            loss = text_sum / text_targets + s.vl_loss_weight * vl_sum / vl_answers
            (loss * world.size).backward()  # FSDP averages gradients over ranks
            sums += torch.stack([text_sum.detach().double(), vl_sum.detach().double(),
                                 torch.tensor(batch.input_ids.shape[1], dtype=torch.float64, device=device)])
        grad_norm, lr, load = self.optimizer_step()
        text_nll, vl_nll, tokens = all_reduce_sum(sums, world).tolist()
        tokens = int(tokens)
        self.tokens_seen += tokens
        text_loss = text_nll / text_targets
        image_loss = vl_nll / vl_answers
        return {"kind": "train", "step": self.step, "loss": text_loss + s.vl_loss_weight * image_loss,
                "text_loss": text_loss, "image_loss": image_loss, "lr": lr, "grad_norm": float(grad_norm),
                "tokens": self.tokens_seen, "images": len(docs), "max_load": round(float(load), 3), "step_tokens": tokens}

    def _targets(self, windows: list[int], docs: list) -> tuple[int, int]:
        """This rank's text targets and VL answers in the step: the losses' normalizers."""
        seq_len = self.s.seq_len
        text = sum(int((window(self.train_data, i, seq_len)[1] != IGNORE_INDEX).sum()) for i in windows)
        return text, sum(d.answers for d in docs)

    def _micro_batches(self, windows: list[int], docs: list) -> list:
        """The step's packed rows on the host, one per micro-batch: its share of windows and documents."""
        s = self.s
        wm, dm = len(windows) // s.grad_accum, len(docs) // s.grad_accum
        return [pack_vl(self.train_data, windows[j * wm:(j + 1) * wm], s.seq_len, docs[j * dm:(j + 1) * dm])
                for j in range(s.grad_accum)]

    # ------------------------------------------------------------------ one step, captured
    def attention_segment(self) -> int | None:
        """None: VL documents do not keep to the text windows' boundaries, so a row attends whole."""
        return None

    def graph_span(self) -> int:
        """A row: its text windows and its VL documents (each about `seq_len` tokens, VLSettings)."""
        s = self.s
        return (s.batch_size + s.vl_scenes) // s.grad_accum * s.seq_len

    def _graph_train_step_vl(self, windows: list[int], docs: list) -> dict | None:
        """train_step through captured graphs (one process): the rows padded to one shape, the two
        normalizers a device vector, the record's `stats` and `vl_stats` read back by _flush_steps.
        None (the step then runs eagerly): the row is longer than MAX_GRAPH_SPAN."""
        text_targets, vl_answers = (max(c, 1) for c in self._targets(windows, docs))
        batches = self._micro_batches(windows, docs)
        tokens = token_bucket(max(b.input_ids.shape[1] for b in batches))
        if tokens > MAX_GRAPH_SPAN:
            return None
        docs_bucket = padded_docs(batches, tokens)
        rows = [pad_vl_batch(b, tokens, docs_bucket, self.config.pad_token_id, self.mm_config.media_placeholder_token_id)
                for b in batches]
        for b, row in zip(batches, rows):  # the model's own placeholder check reads the device: here on the host
            want = 0 if b.grid_thws is None else sum(self.model.placeholder_counts(b.grid_thws))
            if row.image_positions.numel() != want:
                raise TrainError(f"a packed row has {row.image_positions.numel()} image placeholders, its images {want} rows")
        lr = self.scheduler.get_last_lr()[0]
        out = self.graphs.run(rows, (float(text_targets), float(vl_answers)))
        stats = out.clone()  # a copy the next replay keeps
        self.scheduler.step()
        self.step += 1
        step_tokens = sum(b.input_ids.shape[1] for b in batches)
        self.tokens_seen += step_tokens
        return {"kind": "train", "step": self.step, "stats": stats[:3], "vl_stats": stats[3:], "lr": lr,
                "tokens": self.tokens_seen, "images": len(docs), "step_tokens": step_tokens}

    def _graph_body(self, batches: list[VLGraphRow], norms: torch.Tensor) -> torch.Tensor:
        """The step a graph captures: forward and backward of each padded row (the two losses over
        `norms`, [text targets, VL answers] on the device), clip, update, balance over real tokens.
        Returns [loss, grad norm, max load, text loss, image loss] (fp64) on the device."""
        self.model.train()
        w = self.s.vl_loss_weight
        sums = torch.zeros(2, dtype=torch.float64, device=self.world.device)
        for batch in batches:
            text_sum, vl_sum = self._masked_loss_sums(batch)
            (text_sum / norms[0] + w * vl_sum / norms[1]).backward()  # the eager step's loss, as a device expression
            sums += torch.stack([text_sum.detach().double(), vl_sum.detach().double()])
        grad_norm, load = self._update(self.real_tokens(batches))
        text_loss, image_loss = (sums / norms.double()).unbind()
        return torch.stack([text_loss + w * image_loss, grad_norm.double(), load.double(), text_loss, image_loss])

    def _masked_loss_sums(self, batch: VLGraphRow) -> tuple[torch.Tensor, torch.Tensor]:
        """_loss_sums without host reads: logits at every position, the NLL masked (not gathered),
        the images' grids from the row's host metadata, their rows copied by index (a masked
        scatter's backward is a masked select: a host read)."""
        model = self.model
        with self._autocast():
            if batch.pixel_values is None:
                logits = model.language_model(batch.input_ids, cu_seqlens=batch.cu_seqlens)
            else:  # the image rows copied to the placeholder positions found on the host
                embeds = model.embed(batch.input_ids, batch.pixel_values, batch.grids, positions=batch.image_positions)
                logits = model.language_model(inputs_embeds=embeds, cu_seqlens=batch.cu_seqlens)
        nll = F.cross_entropy(logits[0].float(), batch.labels[0], ignore_index=IGNORE_INDEX, reduction="none")
        is_vl = batch.is_vl[0]
        return torch.where(is_vl, 0.0, nll).sum(), torch.where(is_vl, nll, 0.0).sum()

    def _flush_steps(self, records: list[dict], t0: float, bar) -> None:
        """Trainer's, with captured steps' text and image losses read back in the same window."""
        vl = [(r, r.pop("vl_stats")) for r in records if "vl_stats" in r]
        if vl:
            for (r, _), (text, image) in zip(vl, torch.stack([v for _, v in vl]).tolist()):
                r.update(text_loss=text, image_loss=image)
        super()._flush_steps(records, t0, bar)

    # ------------------------------------------------------------------ held-out questions
    def _prompt(self, example: corpus.Example, blank: bool):
        image = Image.new("RGB", example.image.size, corpus.BACKGROUND) if blank else example.image
        pixels, grid, count = self.encoder.image(image)
        return self.encoder.prompt(example.question, count), pixels, grid

    @torch.no_grad()
    def answer(self, examples: list[corpus.Example], *, blank: bool = False) -> list[str]:
        """Greedy replies to the chat prompts, as the server gives them: until `<|end_of_msg|>` or
        eos (at most `max_answer_tokens` past the reply's markers), parsed by the server's reply
        parser, the content stripped; `blank` shows a blank canvas of the same size instead of
        each image (the text-only baseline)."""
        device = self.world.device
        stops = self.encoder.chat.stop_ids
        budget = self.encoder.reply_overhead + self.s.max_answer_tokens
        was_training = self.model.training
        self.model.eval()
        answers: list[str] = []
        for start in range(0, len(examples), VQA_CHUNK):
            rendered, pixels, grids = zip(*(self._prompt(ex, blank) for ex in examples[start:start + VQA_CHUNK]))
            prompts = [r.token_ids for r in rendered]
            n = len(prompts)
            ids = torch.tensor([t for p in prompts for t in p], device=device)[None]
            cu = torch.tensor([0] + [len(p) for p in prompts], device=device).cumsum(0)
            cache = K3Cache.empty(self.config, n, device=device)
            with self._autocast():
                logits = self.model(ids, torch.cat(pixels).to(device), torch.tensor(grids, device=device),
                                    cu_seqlens=cu, cache=cache, logits_to_keep=cu[1:] - 1)[0]
            outputs: list[list[int]] = [[] for _ in range(n)]
            active, finished = list(range(n)), set()
            for _ in range(budget):
                tokens = logits.argmax(-1)
                still = []
                for row, seq in enumerate(active):
                    if seq in finished:
                        continue
                    token = int(tokens[row])
                    outputs[seq].append(token)
                    if token not in stops and len(outputs[seq]) < budget:
                        still.append(row)
                    else:
                        finished.add(seq)
                if not any_rank(bool(still), self.world):
                    break
                # a rank done before the others decodes its last rows on (unread): FSDP's forward is a collective
                if still and len(still) < len(active):
                    cache, tokens, active = cache.select(still), tokens[still], [active[r] for r in still]
                with self._autocast():  # the language model itself: a generated placeholder id is just a token
                    logits = self.model.language_model(tokens[None], cu_seqlens=torch.arange(len(active) + 1, device=device),
                                                       cache=cache)[0]
            for r, out in zip(rendered, outputs):
                answers.append(self.encoder.chat.parse_reply(r, out).content.strip())
        self.model.train(was_training)
        return answers

    @torch.no_grad()
    def heldout_loss(self) -> tuple[float, int]:
        """Mean NLL per held-out reply (its answer and markers, teacher-forced), and the replies' token count."""
        was_training = self.model.training
        self.model.eval()
        nats, count = 0.0, 0
        for start in range(0, len(self.heldout), VQA_CHUNK):
            docs = [self.encoder.document(ex.image, [corpus.QA(ex.qtype, ex.question, ex.answer)])
                    for ex in self.heldout[start:start + VQA_CHUNK]]
            batch = pack_vl(None, [], self.s.seq_len, docs).to(self.world.device)
            nats += float(self._loss_sums(batch)[1])
            count += sum(d.targets for d in docs)
        self.model.train(was_training)
        return nats / max(len(self.heldout), 1), count

    @staticmethod
    def accuracy(examples: list[corpus.Example], answers: list[str]) -> tuple[float, dict[str, float]]:
        """Exact-match accuracy overall and per question type (in the corpus's type order)."""
        hits = [a == ex.answer.strip() for ex, a in zip(examples, answers)]
        by_type = {}
        for t in corpus.QUESTION_TYPES:
            mine = [h for h, ex in zip(hits, examples) if ex.qtype == t]
            if mine:
                by_type[t] = sum(mine) / len(mine)
        return sum(hits) / max(len(hits), 1), by_type

    # ------------------------------------------------------------------ eval and samples
    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None) -> dict:
        """Text val loss / bpb (Trainer's), plus the held-out answers' loss and accuracy."""
        record = super().evaluate(max_windows)
        loss, count = self.heldout_loss()
        self._last_answers = self.answer(self.heldout)
        acc, by_type = self.accuracy(self.heldout, self._last_answers)
        record.update(val_image_loss=loss, val_image_tokens=count, vqa_accuracy=acc, vqa_by_type=by_type,
                      vqa_questions=len(self.heldout))
        return record

    def eval_line(self, ev: dict) -> str:
        """Trainer's line, then the held-out questions' accuracy, overall and by type."""
        types = " / ".join(f"{t} {100 * a:.0f}" for t, a in ev["vqa_by_type"].items())
        return f"{super().eval_line(ev)}; held-out questions {100 * ev['vqa_accuracy']:.1f}% ({types})"

    @torch.no_grad()
    def samples(self, temperature: float = 0.8, top_p: float = 0.95) -> list[dict]:
        """Text continuations of the sample prompts, and the last eval's answers to four held-out questions."""
        bos = self.config.bos_token_id
        prompts = [[bos] + self.tokenizer.encode(p).ids for p in self.s.sample_prompts]
        self.model.eval()
        outs = generate(self.model.language_model, prompts, self.s.sample_tokens, temperature=temperature,
                        top_p=top_p, eos_token_id=self.config.eos_token_id, seed=self.s.seed)
        self.model.train()
        out = [{"kind": "sample", "step": self.step, "prompt": p, "text": self.tokenizer.decode(o)}
               for p, o in zip(self.s.sample_prompts, outs)]
        for ex, a in list(zip(self.heldout, self._last_answers))[:4]:
            out.append({"kind": "sample", "step": self.step, "prompt": f"[image] {ex.question}",
                        "text": f" -> {a!r} (truth {ex.answer!r})"})
        return out

    # ------------------------------------------------------------------ the end
    def baselines(self) -> dict:
        """Text-only figures on the held-out questions: the corpus's majority answer per question
        (counted over `baseline_examples` training examples) and this model shown blank images."""
        majority = corpus.TextOnlyBaseline(corpus.examples("train", self.s.baseline_examples, self.s.seed,
                                                           size=self.s.image_size))
        maj_answers = [majority.answer(ex.question) for ex in self.heldout]
        blank_answers = self.answer(self.heldout, blank=True)
        maj, maj_by_type = self.accuracy(self.heldout, maj_answers)
        blank, blank_by_type = self.accuracy(self.heldout, blank_answers)
        return {"majority_accuracy": maj, "majority_by_type": maj_by_type,
                "blank_image_accuracy": blank, "blank_image_by_type": blank_by_type}

    def train(self) -> dict:
        result = super().train()
        t0 = time.perf_counter()
        base = self.baselines()
        self.elapsed += time.perf_counter() - t0
        record = {"kind": "vqa", "step": self.step, "questions": len(self.heldout),
                  "accuracy": result["vqa_accuracy"], "by_type": result["vqa_by_type"], **base,
                  "elapsed": round(self.elapsed, 2)}
        if self.world.is_main:
            self.metrics.write(record)
            self.write_outputs(self.metrics.read(), Path(result["checkpoint"]))
        result.update(vqa=record, elapsed=self.elapsed)
        return result

    def write_outputs(self, records: list[dict], checkpoint: Path | None) -> None:
        s = self.s
        plot_vl_losses(records, self.run_dir / PLOT_FILE,
                       title=f"{self.run_dir.name}: {self.params['total'] / 1e6:.1f}M text + "
                             f"{self.vision_params['total'] / 1e6:.2f}M vision parameters")
        extra = []
        vqa = [r for r in records if r["kind"] == "vqa"]
        evals = [r for r in records if r["kind"] == "eval" and "vqa_accuracy" in r]
        if evals:
            e = evals[-1]
            v = vqa[-1] if vqa else {}
            types = list(e["vqa_by_type"])
            extra = ["## Held-out visual questions", "",
                     (f"{e['vqa_questions']} questions of the shapes corpus's held-out split (step {e['step']}), "
                     f"each as the chat prompt `/v1/chat/completions` renders for one image and the question "
                     f"(thinking {'on' if s.vl_thinking else 'off'}); greedy reply until end_of_msg, its content "
                     f"exact-matched after strip. Reply loss {e['val_image_loss']:.4f} nats per reply "
                     f"({e['val_image_tokens']} tokens)."), "",
                     "| | all | " + " | ".join(t.replace("_", " ") for t in types) + " |",
                     "|---|---|" + "---|" * len(types),
                     f"| this model | **{e['vqa_accuracy']:.1%}** | " + " | ".join(f"{e['vqa_by_type'][t]:.1%}" for t in types) + " |"]
            if v:
                extra += [f"| same model, blank images | {v['blank_image_accuracy']:.1%} | "
                          + " | ".join(f"{v['blank_image_by_type'].get(t, 0):.1%}" for t in types) + " |",
                          f"| majority answer per question (text only) | {v['majority_accuracy']:.1%} | "
                          + " | ".join(f"{v['majority_by_type'].get(t, 0):.1%}" for t in types) + " |"]
            extra.append("")
        params = {**self.params, "total": self.params["total"] + self.vision_params["total"],
                  "active": self.params["active"] + self.vision_params["total"]}
        write_report(self.run_dir / REPORT_FILE, settings=dataclasses.asdict(s), params=params, records=records,
                     wall_time_s=self.elapsed, checkpoint=checkpoint, title="k3 vision-language training run",
                     model=(f"{s.config}: K3 text model ({self.params['total'] / 1e6:.2f}M) + MoonViT-V2 tower and "
                            f"projector ({self.vision_params['total'] / 1e6:.2f}M)"),
                     data=(f"{s.data or 'bundled Shakespeare corpus'} + generated shapes scenes "
                           f"({s.image_size} px, {s.vl_questions} questions each as chat turns)"),
                     batch=(f"{s.batch_size} text windows x {s.seq_len} tokens + {s.vl_scenes} scenes"), extra=extra)


def plot_vl_losses(records: list[dict], path: Path, title: str) -> None:
    """Two panels: text tokens (train and val loss) and VL replies (train and held-out loss per
    reply, with held-out accuracy on a second axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train" and "text_loss" in r]
    evals = [r for r in records if r["kind"] == "eval" and "vqa_accuracy" in r]
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in train]
    ax_t.plot(steps, [r["text_loss"] for r in train], lw=1, label="train (text windows)")
    ax_t.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val (held-out text)")
    ax_t.set_title("text tokens")
    ax_v.plot(steps, [r["image_loss"] for r in train], lw=1, color="C2", label="train (answers after an image)")
    ax_v.plot([r["step"] for r in evals], [r["val_image_loss"] for r in evals], "o-", color="C3",
              label="held-out questions")
    ax_v.set_title("replies to image questions")
    ax_t.set_ylabel("loss (nats/token)")
    ax_v.set_ylabel("loss (nats/reply)")
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    later = [r["image_loss"] for r in train[len(train) // 10:]]
    if later:  # the first steps' reply loss is many times the rest: keep the scale for the rest
        ax_v.set_ylim(0, 1.5 * max(later + [r["val_image_loss"] for r in evals]))
    if evals:
        acc = ax_v.twinx()
        acc.plot([r["step"] for r in evals], [r["vqa_accuracy"] for r in evals], "s--", color="C4",
                 label="held-out accuracy")
        acc.set_ylim(0, 1)
        acc.set_ylabel("accuracy")
        acc.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)

