"""The settings the training verbs share, declared once, and the flags built from them.

A section is a dataclass of fields several verbs have: RunSettings (out, steps, eval_every, seed,
device, cache_dir), DataSettings, BatchSettings, OptimizerSettings, CheckpointSettings and
StartSettings. Each verb's settings class (TrainSettings, VLSettings, SFTSettings, and
RolloutSettings with its RLSettings and DistillSettings) inherits the sections it has and declares
only its own fields, so settings stay flat (run.json is `dataclasses.asdict` of them) and a shared
field has one declaration: its type, its help and, where the verbs agree, its default. Where they
do not, the verb's `DEFAULTS` table gives its value (applied by @settings; the field is not
declared again), and where a flag means something verb-specific (RL's `--steps` counts
iterations) its `HELP` table words it.

`add_settings_arguments` gives a verb's parser the flags of every section its settings have, one
argparse group per section, with that verb's defaults in the help. A verb class lists its sections
last-first: dataclass fields follow the reversed MRO, so run.json reads data, run, batch, optimizer,
checkpoints, then the verb's own.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
from dataclasses import MISSING, dataclass, field
from typing import Any

from k3.train.muon import OPTIMIZERS

BALANCE_RULES = ("quantile", "histogram", "sign", "none")
PRECISIONS = ("bf16", "fp32")  # CUDA compute; the CPU computes in fp32 whatever is set
# a flag's type from its field's annotation (postponed annotations: strings); a string flag takes argparse's own
_FLAG_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "str": None, "str | None": None}
RESUME_HELP = "continue a run from its latest checkpoint, with its saved settings"


def option(default: Any = MISSING, help: str = "", **flag) -> Any:
    """A settings field with a flag: `--name`, or `--no-name` for a bool that is on by default.
    `help` may place the verb's default as {default}; else " (default X)" ends it (not for a bool, a
    None or an empty default, whose help says what happens). `flag`: more add_argument keywords (choices)."""
    return field(default=default, metadata={"help": help, **flag})


def settings(cls):
    """@dataclass(kw_only=True) plus the class's DEFAULTS: values of fields it inherits, for it and
    its subclasses, without declaring them again (so a field keeps one declaration)."""
    own_fields = set(vars(cls).get("__annotations__", {}))
    cls = dataclass(kw_only=True)(cls)
    fields = cls.__dataclass_fields__
    defaults = dict(vars(cls).get("DEFAULTS", {}))
    for name, value in defaults.items():
        if name not in fields or name in own_fields:
            raise TypeError(f"{cls.__name__}.DEFAULTS names {name!r}, which is no field it inherits "
                            "(a field it declares takes its default there)")
        if isinstance(value, (list, dict, set)):
            raise TypeError(f"{cls.__name__}.DEFAULTS[{name!r}] must be immutable, got {value!r}")
        f = copy.copy(fields[name])  # the section's Field stays as it is for the other verbs
        f.default, f.default_factory = value, MISSING
        fields[name] = f  # subclasses build their __init__ from it
        setattr(cls, name, value)
    unknown = sorted(set(vars(cls).get("HELP", {})) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__}.HELP names no field: {unknown}")
    if defaults:
        generated = cls.__init__

        def __init__(self, **kwargs):
            generated(self, **{**defaults, **kwargs})

        signature = inspect.signature(generated)
        __init__.__signature__ = signature.replace(parameters=[
            p.replace(default=defaults[p.name]) if p.name in defaults else p for p in signature.parameters.values()])
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__
    return cls


# ---------------------------------------------------------------------- the sections
@settings
class StartSettings:
    """The checkpoint a post-training run starts from (`k3 sft`, `k3 rl`, `k3 distill`)."""
    TITLE = "start (one of)"
    init: str = option("", "start from this run's latest checkpoint")  # --run RUN_DIR or --model CHECKPOINT_DIR


@settings
class DataSettings:
    """What the run learns from, and how much of it is held out."""
    TITLE = "data"
    data: str | None = option(None, "the training data (default: the verb's own set)")
    val_fraction: float = option(help="share of the documents held out for evaluation")


@settings
class RunSettings:
    """Where a run goes, how long it runs and where it computes."""
    TITLE = "run"
    out: str | None = option(None, "run folder (default runs/<verb>-<timestamp>)")
    steps: int = option(help="optimizer steps")
    eval_every: int = option(help="steps between held-out evals")
    seed: int = option(0, "the run's seed: its data order, its sampling and a new model's initialization follow "
                          "from it")
    device: str = option("cpu", "where to train: cpu, cuda or cuda:N (default {default}; under torchrun each rank "
                                "takes its own GPU)")
    # tokenizer/token cache; None: $K3_CACHE_DIR or ~/.cache/k3. No shared flag: `k3 train` tokenizes into it
    # and adds --cache-dir; post-training verbs start from a run's tokenizer and cache nothing
    cache_dir: str | None = None


@settings
class BatchSettings:
    """The global batch of one optimizer step, over all ranks and micro-batches."""
    TITLE = "batch"
    batch_size: int = option(help="sequences per optimizer step, all ranks together")
    seq_len: int = option(help="tokens per sequence")
    grad_accum: int = option(1, "micro-batches per step")


@settings
class OptimizerSettings:
    """One optimizer step: Per-Head Muon + AdamW, warmup-cosine, clipping, the expert-balance rule."""
    TITLE = "optimizer step"
    lr: float = option(help="peak learning rate, Muon and AdamW")
    min_lr_ratio: float = option(help="the learning rate the cosine decays to, as a share of the peak")
    weight_decay: float = option(help="decoupled weight decay of matrices and embeddings; norms and biases get none")
    grad_clip: float = option(1.0, "max global gradient norm")
    optimizer: str = option(OPTIMIZERS[0], "matrix weights' update: K3's Per-Head Muon, whole-matrix Muon, or "
                                           "AdamW for every parameter", choices=OPTIMIZERS)
    # DESIGN §6: Quantile Balancing by default
    balance: str = option(BALANCE_RULES[0], "expert-balance rule after each step", choices=BALANCE_RULES)
    qat: bool = option(False, "quantization-aware training: MXFP4 weights / MXFP8 activations on the routed experts")
    compile: bool = option(False, "torch.compile each layer's norms, mixer and FFN and the AttnRes reads (worth it "
                                  "on CUDA; minutes of compiling first)")
    precision: str = option(PRECISIONS[0], "compute on CUDA: bf16 autocast over fp32 weights, or fp32 throughout "
                                          "(slower; what the CPU computes, to tell a precision effect apart)",
                            choices=PRECISIONS)
    cuda_graphs: bool = option(True, "on one CUDA device, capture each training step (forward, backward, update) "
                                     "as a CUDA graph and replay it: small models stop being launch-bound "
                                     "(DESIGN §14.5; ignored on CPU, under torchrun and --qat)")


@settings
class CheckpointSettings:
    """How often the run saves, and what it keeps."""
    TITLE = "checkpoints"
    ckpt_every: int = option(help="steps between checkpoints")
    keep: int = option(help="checkpoints to keep (default {default}); only the latest keeps the optimizer state "
                            "--resume needs, older ones the model and tokenizer")
    keep_all_state: bool = option(False, "keep the optimizer/RNG state in every kept checkpoint, not only the latest")


# ---------------------------------------------------------------------- flags
def sections(cls) -> list[type]:
    """The sections `cls` has, in the order of its fields (a verb's own may be one: RolloutSettings)."""
    return [k for k in reversed(cls.__mro__) if "TITLE" in vars(k)]


def declared_in(cls, name: str) -> type:
    """The class of `cls`'s MRO that declares field `name`."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def help_text(cls, name: str, defaults, also: tuple[str, Any] | None = None) -> str:
    """Field `name`'s help for `cls`'s verb: its HELP wording if it has one, else the declaration's,
    with the verb's default (and `also`'s, (label, settings), where that one differs)."""
    text = next((vars(k)["HELP"][name] for k in cls.__mro__ if name in vars(k).get("HELP", {})),
                cls.__dataclass_fields__[name].metadata.get("help", ""))
    value = getattr(defaults, name)
    shown = str(value)
    if also is not None and getattr(also[1], name) != value:
        shown += f"; {also[0]}: {getattr(also[1], name)}"
    if "{default}" in text:
        return text.replace("{default}", shown)
    if isinstance(value, bool) or value in (None, ""):
        return text
    return f"{text} (default {shown})".lstrip()


def add_settings_arguments(parser: argparse.ArgumentParser, cls, *, resume: str = "RUN_DIR",
                           also: tuple[str, type] | None = None) -> dict[str, argparse._ArgumentGroup]:
    """The flags of every section `cls` has, one group each, every one defaulting to None (a flag left
    out keeps the settings' default; `--resume` refuses any other). StartSettings gives --run /
    --model / --resume, one of them; without it --resume (metavar `resume`) opens the run group.
    --no-progress joins the verb's own options. `also` = (label, settings class): defaults the verb takes instead for
    some runs (`k3 train`'s VL configs), shown where they differ. Returns the groups by title, so
    the verb can add its own flags where they belong."""
    defaults = cls()
    other = (also[0], also[1]()) if also is not None else None
    starts = StartSettings in cls.__mro__
    groups = {}
    for section in sections(cls):
        group = groups[section.TITLE] = parser.add_argument_group(section.TITLE)
        if section is StartSettings:
            one = group.add_mutually_exclusive_group()
            one.add_argument("--run", dest="init_run", metavar="RUN_DIR", help=help_text(cls, "init", defaults))
            one.add_argument("--model", dest="init_model", metavar="CHECKPOINT_DIR",
                             help="start from this checkpoint folder")
            one.add_argument("--resume", metavar=resume, help=RESUME_HELP)
            continue
        if section is RunSettings and not starts:
            group.add_argument("--resume", metavar=resume, help=RESUME_HELP)
        for f in dataclasses.fields(cls):
            if declared_in(cls, f.name) is section and "help" in f.metadata:
                _add_flag(group, cls, f, defaults, other)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return groups


def _add_flag(group, cls, f: dataclasses.Field, defaults, also) -> None:
    flag = "--" + f.name.replace("_", "-")
    help = help_text(cls, f.name, defaults, also)
    extra = {k: v for k, v in f.metadata.items() if k != "help"}
    if f.type == "bool":  # every flag defaults to None: given or not is what --resume checks
        if getattr(defaults, f.name):
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", default=None, help=help)
        else:
            group.add_argument(flag, action="store_true", default=None, help=help)
        return
    if f.type not in _FLAG_TYPES:
        raise TypeError(f"{cls.__name__}.{f.name}: no flag for a field of type {f.type!r}")
    kind = _FLAG_TYPES[f.type]
    group.add_argument(flag, **({"type": kind} if kind else {}), help=help, **extra)


def given_settings(args: argparse.Namespace, cls) -> dict:
    """The settings fields the command line set (a flag left out is None), `init` from --run / --model."""
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
               if getattr(args, f.name, None) is not None}
    init = getattr(args, "init_run", None) or getattr(args, "init_model", None)
    if init:
        changes["init"] = init
    return changes
