"""The built-in ablation studies and scales, and how each study matches its variants' budgets.

A study is a baseline (K3's choice, DESIGN §2-§9) and the common alternatives, each a `Variant`: K3Config
overrides plus TrainSettings changes. Every variant of a study trains on the same data, the same
tokens per step and the same number of steps, with the same schedule. Where a variant changes the
parameter count, the study names the config fields (`knobs`) that are solved so that its total and
active parameters (k3/model/params.py's convention) equal the baseline's; the tolerance is MATCH_TOL.

A scale fixes the model and the budget (preset, steps, batch, length, seeds); `Scale.smoke()` is
the `--quick` smoke run of the same code.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from k3.config import K3Config
from k3.model.params import count_parameters
from k3.train.trainer import TrainSettings, model_config

MATCH_TOL = 0.02  # a "matched" variant's total and active parameters are within 2% of the baseline's


class AblateError(ValueError):
    """A bad study, scale or matching request; printed as one line by `k3 ablate`."""


@dataclass(frozen=True)
class Scale:
    name: str
    config: str  # preset name
    overrides: dict = field(default_factory=dict)  # on top of the preset, for every variant
    steps: int = 96
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 4e-3
    lr_grid: tuple[float, ...] = (2e-3, 4e-3, 8e-3)  # the optimizer study's sweep, per optimizer
    eval_every: int = 32
    eval_windows: int = 64  # the same held-out windows in every eval of every run
    ckpt_every: int | None = None  # None: at every eval (a killed run loses at most one eval interval)
    seeds: int = 3
    device: str = "cpu"
    smoke_overrides: dict = field(default_factory=dict)  # what `--quick` changes besides the budget

    def smoke(self) -> Scale:
        """`--quick`: the same code on a few steps (and, on CPU, a smaller model), two seeds."""
        return dataclasses.replace(self, name=f"{self.name}-quick", overrides={**self.overrides, **self.smoke_overrides},
                                   steps=3, batch_size=2, seq_len=min(self.seq_len, 64), eval_every=2, eval_windows=1,
                                   ckpt_every=None, seeds=2, lr_grid=(self.lr,))

    def settings(self, seed: int, **changes) -> TrainSettings:
        fields = {"config": self.config, "overrides": dict(self.overrides), "steps": self.steps,
                  "batch_size": self.batch_size, "seq_len": self.seq_len, "lr": self.lr, "seed": seed,
                  "eval_every": self.eval_every, "eval_windows": self.eval_windows,
                  "ckpt_every": self.ckpt_every or self.eval_every, "keep": 1, "sample_tokens": 0, "device": self.device}
        return TrainSettings(**{**fields, **changes})

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


SCALES = {
    # k3-tiny as preset (8 layers, 4.3M parameters, 2.0M active); 98k tokens: ~2 min a run on one thread
    "cpu": Scale("cpu", "k3-tiny", smoke_overrides={
        "vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64, "num_experts": 4,
        "routed_expert_hidden_size": 32, "moe_intermediate_size": 32, "kda_chunk_size": 16}),
    # k3-1b (24 layers, ~1.4B total / ~0.3B active) on one GPU; 3.3M tokens a run. A checkpoint is
    # model + optimizer (~17 GB): only the final one is written
    "gpu": Scale("gpu", "k3-1b", steps=200, batch_size=16, seq_len=1024, lr=2e-3, lr_grid=(1e-3, 2e-3, 4e-3),
                 eval_every=50, eval_windows=32, ckpt_every=200, seeds=1, device="cuda"),
}


@dataclass(frozen=True)
class Variant:
    name: str
    what: str  # one line for the table
    overrides: dict = field(default_factory=dict)  # K3Config fields
    train: dict = field(default_factory=dict)  # TrainSettings fields (optimizer, balance, qat, lr)
    metric: str = "val_bpb"  # the measurement that is this variant's score (k3/ablate/measure.py)
    knobs: tuple[tuple[str, str], ...] = ()  # (K3Config field, "total" | "active") solved to match the baseline
    sweep_lr: bool = False  # tuned: the learning rate is picked by a sweep over Scale.lr_grid on the first seed


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    question: str
    matching: str  # how total and active parameters are matched (stated in the table)
    build: Callable[[K3Config], list[Variant]]  # baseline first
    figures: tuple[tuple[str, str], ...] = ()  # (measurement, column title): the study's own figures
    curve: tuple[str, str] | None = None  # (train-record field, axis title): a second plot panel


def _mixers(base: K3Config) -> list[Variant]:
    n = base.num_hidden_layers
    knob = (("intermediate_size", "total"),)
    return [Variant("kda-mla-3:1", f"K3: {base.num_kda_layers} KDA + {base.num_mla_layers} MLA (MLA every 4th and last)"),
            Variant("all-mla", f"{n} MLA layers", {"kda_layers": [], "full_attn_layers": list(range(1, n + 1))}, knobs=knob),
            Variant("all-kda", f"{n} KDA layers", {"kda_layers": list(range(1, n + 1)), "full_attn_layers": []}, knobs=knob)]


def _residuals(base: K3Config) -> list[Variant]:
    out = [Variant(f"attnres-{base.attn_res_block_size}", f"K3: Block AttnRes, blocks of {base.attn_res_block_size} layers")]
    out += [Variant(f"attnres-{b}", f"Block AttnRes, blocks of {b} layer{'s' if b > 1 else ''}", {"attn_res_block_size": b})
            for b in (1, 2, 4) if b != base.attn_res_block_size and b <= base.num_hidden_layers]
    return out + [Variant("prenorm", "plain pre-norm residual", {"attn_res_block_size": None})]


def _ffns(base: K3Config) -> list[Variant]:
    return [Variant("latentmoe-situ", f"K3: LatentMoE (experts at width {base.routed_expert_hidden_size}), SiTU-GLU"),
            Variant("moe-situ", "plain MoE at the model width, SiTU-GLU", {"routed_expert_hidden_size": None},
                    knobs=(("moe_intermediate_size", "active"), ("num_experts", "total"))),
            Variant("latentmoe-swiglu", "LatentMoE, SwiGLU everywhere", {"hidden_act": "silu"})]


def _balances(base: K3Config) -> list[Variant]:
    return [Variant("quantile", "K3: Quantile Balancing (one-shot bias from this step's scores)"),
            Variant("sign", "DeepSeek-V3 sign update of the bias", train={"balance": "sign"}),
            Variant("none", "no balancing", train={"balance": "none"})]


def _optimizers(base: K3Config) -> list[Variant]:
    return [Variant("per-head-muon", "K3: Muon orthogonalizing each attention head's block", sweep_lr=True),
            Variant("muon", "Muon on whole matrices", train={"optimizer": "muon"}, sweep_lr=True),
            Variant("adamw", "AdamW for every parameter", train={"optimizer": "adamw"}, sweep_lr=True)]


def _positions(base: K3Config) -> list[Variant]:
    return [Variant("nope", "K3: MLA without positions (order only from the KDA layers)"),
            Variant("rope", "decoupled RoPE on MLA's pe slot (DeepSeek-style)", {"mla_use_nope": False})]


def _precisions(base: K3Config) -> list[Variant]:
    return [Variant("high-precision", "no quantization (fp32 on CPU, bf16 autocast on CUDA)"),
            Variant("mxfp4-qat", "K3: QAT, routed experts with MXFP4 weights / MXFP8 inputs", train={"qat": True}),
            Variant("mxfp4-ptq", "the high-precision run, routed experts' weights rounded to MXFP4 after training",
                    metric="val_bpb_mxfp4")]


SAME = "same parameters by construction (the variants change no tensor shapes)"
STUDIES = {s.name: s for s in (
    Study("mixer", "Mixer layout: 3:1 KDA/MLA vs all-MLA vs all-KDA",
          "Does the 3:1 hybrid match full attention's quality, and what does it do at 4x the training length?",
          "total and active matched through the dense layer-0 FFN width (`intermediate_size`): attention "
          "parameters that a layout adds or removes are taken from or given to that FFN",
          _mixers, figures=(("val_bpb_4x", "val bpb at 4x length"),)),
    Study("residual", "Residual: Block AttnRes (blocks of 1, 2, 4 layers) vs plain pre-norm",
          "Does attending over earlier blocks' outputs beat the plain residual stream, and at which block size?",
          "matched without adjustment: AttnRes adds only one pseudo-query and one norm per layer read "
          "(a fraction of a percent)", _residuals),
    Study("ffn", "FFN: LatentMoE vs plain MoE; SiTU-GLU vs SwiGLU",
          "Does routing experts through a latent width lose quality at equal active and total parameters, "
          "and does SiTU-GLU bound activations without costing loss?",
          "plain MoE: expert width (`moe_intermediate_size`) solved for the active count and the expert "
          "count (`num_experts`) for the total, top-k kept; SwiGLU: same parameters",
          _ffns, figures=(("max_act", "max abs GLU output"), ("loss_spikes", "loss spikes")), curve=("loss", "train loss")),
    Study("balance", "Expert balancing: Quantile Balancing vs the sign update vs none",
          "How even is the expert load during training, and does balancing cost loss?", SAME, _balances,
          figures=(("load_mean", "max/mean load (mean over steps)"), ("load_final", "max/mean load (last 10% of steps)")),
          curve=("max_load", "max/mean expert load")),
    Study("optimizer", "Optimizer: Per-Head Muon vs Muon vs AdamW (each at its tuned learning rate)",
          "Is orthogonalizing per attention head better than per matrix, and Muon better than AdamW?", SAME,
          _optimizers, figures=(("lr", "tuned lr"),)),
    Study("positions", "MLA positions: NoPE (K3) vs decoupled RoPE",
          "Does leaving position to the KDA layers cost quality, and does it hold at 4x the training length?",
          SAME, _positions, figures=(("val_bpb_4x", "val bpb at 4x length"),)),
    Study("precision", "Precision: MXFP4/MXFP8 QAT vs high precision vs MXFP4 after training",
          "What does MXFP4 cost in loss, with and without quantization-aware training?", SAME, _precisions,
          figures=(("val_bpb_mxfp4", "val bpb, MXFP4 weights"),)),
)}


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise AblateError(f"unknown study {name!r}; choose from {', '.join(STUDIES)} or all")
    return STUDIES[name]


def get_scale(name: str, quick: bool = False) -> Scale:
    if name not in SCALES:
        raise AblateError(f"unknown scale {name!r}; choose from {', '.join(SCALES)}")
    return SCALES[name].smoke() if quick else SCALES[name]


@functools.lru_cache(maxsize=4096)
def _counts(config: str, overrides_json: str) -> tuple[int, int]:
    p = count_parameters(model_config(config, json.loads(overrides_json)))
    return p["total"], p["active"]


def counts(config: str, overrides: dict) -> dict:
    """Total and active parameters of a preset with K3Config overrides (as the trainer resolves them)."""
    total, active = _counts(config, json.dumps(overrides, sort_keys=True))
    return {"total": total, "active": active}


def _solve_one(config: str, overrides: dict, field_name: str, target: str, want: int) -> int:
    """The integer value of `field_name` (>= 1) whose `target` count is closest to `want`. Every knob
    we use (an FFN width, an expert count) moves the counts linearly, so two counts give the slope."""
    def count(v: int) -> int:
        return counts(config, {**overrides, field_name: v})[target]
    v0 = int(overrides[field_name])
    slope = count(v0 + 1) - count(v0)
    if slope <= 0:
        raise AblateError(f"{field_name} does not change the {target} parameter count: it cannot match it")
    guess = max(1, round(v0 + (want - count(v0)) / slope))
    return min(range(max(1, guess - 1), guess + 2), key=lambda v: abs(count(v) - want))


def match(config: str, base: dict, variant: Variant) -> dict:
    """The variant's overrides with its knobs solved so its counts equal the baseline's (`base`: the
    scale's overrides). Knobs are solved in turn, a few rounds (each count depends a little on both)."""
    overrides = {**base, **variant.overrides}
    if not variant.knobs:
        return overrides
    base_config = model_config(config, base)
    want = counts(config, base)
    for name, _ in variant.knobs:
        overrides.setdefault(name, getattr(base_config, name))
    for _ in range(3):
        for name, target in variant.knobs:
            overrides[name] = _solve_one(config, overrides, name, target, want[target])
    if len(variant.knobs) > 1:  # integer knobs rarely hit both counts: descend on the worse of the two errors
        def worst(o: dict) -> float:
            return max(abs(v) for v in mismatch(config, base, o).values())
        improved = True
        while improved:
            improved = False
            for name, _ in variant.knobs:
                for step in (-1, 1):
                    trial = {**overrides, name: overrides[name] + step}
                    if trial[name] >= 1 and worst(trial) < worst(overrides):
                        overrides, improved = trial, True
    if "num_experts" in dict(variant.knobs) and overrides["num_experts"] <= base_config.num_experts_per_token:
        raise AblateError(f"variant {variant.name}: matching left {overrides['num_experts']} experts, not more than top-k")
    return overrides


def mismatch(config: str, base: dict, overrides: dict) -> dict:
    """Relative differences of total and active parameters from the baseline's."""
    want, got = counts(config, base), counts(config, overrides)
    return {k: (got[k] - want[k]) / want[k] for k in ("total", "active")}


@dataclass(frozen=True)
class Planned:
    """A study's variant resolved at a scale: the overrides after matching, and its counts."""
    variant: Variant
    overrides: dict
    params: dict
    mismatch: dict

    @property
    def matched(self) -> bool:
        return all(abs(v) <= MATCH_TOL for v in self.mismatch.values())


def plan(study: Study, scale: Scale) -> list[Planned]:
    base_config = model_config(scale.config, scale.overrides)
    out = []
    for variant in study.build(base_config):
        overrides = match(scale.config, scale.overrides, variant)
        out.append(Planned(variant, overrides, counts(scale.config, overrides),
                           mismatch(scale.config, scale.overrides, overrides)))
    return out
