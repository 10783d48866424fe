"""`k3 train`: with no arguments, trains k3-tiny on the bundled Shakespeare corpus on CPU.

Distributed: `torchrun --nproc-per-node N -m k3 train ...` (FSDP2; gloo on CPU, NCCL on CUDA).
Every default lives in TrainSettings; flags left out keep it. A vision-language config
(`--config k3-tiny-vl`, or a config.json with a vision_config) trains with VLTrainer and VLSettings'
defaults instead (k3/train/vl_trainer.py, DESIGN §7).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from k3.checkpoint.run_folder import CheckpointUnreadableError, check_readable, latest_checkpoint
from k3.checkpoint.training_state import CheckpointSaveError, ResumeStateError
from k3.config import ConfigError
from k3.data.corpus import DataError
from k3.train.init import INITS
from k3.train.settings import add_settings_arguments, given_settings
from k3.train.trainer import MAX_EVAL_TOKENS, Trainer, TrainError, TrainSettings

_DEFAULTS = TrainSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from k3.train.vl_trainer import VLSettings

    d, vl_defaults = _DEFAULTS, VLSettings()
    p.add_argument("--config", "--preset", dest="config", help=f"preset name or config.json path (default {d.config})")
    p.add_argument("--set", dest="overrides", action="append", metavar="FIELD=VALUE",
                   help="change a K3Config field, VALUE as JSON (e.g. --set num_hidden_layers=4); repeatable")
    p.add_argument("--weight-init", choices=INITS,
                   help="a model from scratch: zero-out starts each residual branch's last projection at zero "
                        "(nanochat's init; k3-tiny learns to copy in context several times sooner), normal keeps "
                        f"K3's N(0, initializer_range) everywhere (default {d.weight_init})")
    groups = add_settings_arguments(p, TrainSettings, also=("VL configs", VLSettings))
    groups["data"].add_argument(
        "--copy-share", type=float,
        help="share of the training bytes that are copy-shaped documents (random word sequences shown twice), so a "
             f"small model learns to copy; validation stays the corpus's (default {d.copy_share:g})")
    groups["data"].add_argument("--cache-dir", help="tokenizer/token cache (default $K3_CACHE_DIR or ~/.cache/k3)")
    groups["run"].add_argument("--eval-windows", type=int,
                               help="validation windows per eval, the same ones every time (default: all of the "
                                    f"validation split, up to {MAX_EVAL_TOKENS:,} tokens; VL configs: "
                                    f"{vl_defaults.eval_windows})")
    parallel = p.add_argument_group("parallelism (under torchrun)")
    parallel.add_argument("--ep", type=int, help="expert-parallel ranks; routed experts are split over them "
                                                 f"(default {d.ep})")
    parallel.add_argument("--dp", type=int, help="data-parallel ranks (default: world size / --ep)")
    parallel.add_argument("--ep-plan", choices=("balanced", "home"),
                          help="expert placement per micro-batch: balanced (MoonEP's online plan: equal tokens per "
                               f"rank, copies of hot experts) or home (plain EP) (default {d.ep_plan})")
    vl = p.add_argument_group("vision-language configs (--config k3-tiny-vl, or a config.json with a vision_config)")
    vl.add_argument("--vl-scenes", type=int,
                    help=f"generated scenes per step, all ranks together (default {vl_defaults.vl_scenes})")
    vl.add_argument("--vl-questions", type=int,
                    help=f"questions per scene, each a chat turn (default {vl_defaults.vl_questions})")
    vl.add_argument("--image-size", type=int,
                    help=f"scene canvas in pixels (default {vl_defaults.image_size}: one merged token per grid cell)")
    vl.add_argument("--vl-thinking", action="store_true", default=None,
                    help="train the conversations with the think channel on (default off)")


VL_FLAGS = ("vl_scenes", "vl_questions", "image_size", "vl_thinking")


def _settings(args, defaults: TrainSettings = _DEFAULTS) -> TrainSettings:
    changes = given_settings(args, type(defaults))
    changes.pop("overrides", None)  # --set FIELD=VALUE items, read here
    overrides = {}
    for item in args.overrides or []:
        field, sep, value = item.partition("=")
        if not sep:
            raise TrainError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value  # a bare string such as --set kda_impl=chunk
    return dataclasses.replace(defaults, **changes, overrides=overrides)


def _is_vl_run(args) -> bool:
    """A VL config named, or a VL run resumed (its run.json has VLSettings' fields)."""
    from k3.train.vl_config import is_vl_config

    if args.resume:
        try:
            return "vl_scenes" in json.loads((Path(args.resume) / "run.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
            return False  # Trainer.from_run reports the unreadable run file
    return is_vl_config(args.config)


def interrupt_advice(run_dir, ckpt_every: int, verb: str = "train") -> str:
    """What an interrupted run can do next. A Ctrl-C can land inside an optimizer step, so the
    state at that moment is not saved: resume continues from the latest complete checkpoint."""
    found = latest_checkpoint(Path(run_dir) / "checkpoints")
    if found is None:
        return (f"interrupted before the first checkpoint (one every {ckpt_every} steps): nothing to resume; "
                f"start the run again ({run_dir} can be deleted)")
    step = int(found.name.removeprefix("step_"))
    return f"interrupted; continue from step {step} with: k3 {verb} --resume {run_dir}"


def train_verb(verb: str, args, trainer_class, settings, errors: tuple) -> tuple | int:
    """The life of a training verb: build or resume the trainer, train, close. Returns (trainer,
    result), or the exit code: 2 for the `errors` and an unreadable run or checkpoint folder (one
    line), 130 on Ctrl-C, 1 when a save fails."""
    try:
        if args.resume:
            # every flag of a training verb defaults to None (store_false ones too), so anything else was given
            flag = {"overrides": "set", "share_prompts": "no_share_prompts", "share_prefixes": "no_share_prefixes"}
            given = [f"--{flag.get(k, k).replace('_', '-')}" for k, v in vars(args).items()
                     if v is not None and k not in ("resume", "no_progress")]
            if given:
                raise TrainError(f"--resume continues a run with its saved settings; drop {' '.join(given)}")
            check_readable(args.resume)  # else reported as a folder without a run file
            trainer = trainer_class.from_run(args.resume, progress=not args.no_progress)
        else:
            trainer = trainer_class(settings(args), progress=not args.no_progress)
    except (*errors, CheckpointUnreadableError) as e:
        print(f"k3 {verb}: error: {e}", file=sys.stderr)
        return 2
    try:
        return trainer, trainer.train()
    except KeyboardInterrupt:
        if trainer.world.is_main:
            print(f"\n{interrupt_advice(trainer.run_dir, trainer.s.ckpt_every, verb)}", file=sys.stderr)
        return 130
    except CheckpointSaveError as e:
        print(f"k3 {verb}: error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()


def run(args) -> int:
    trainer_class, settings = Trainer, _settings
    if _is_vl_run(args):
        from k3.train.vl_trainer import VLSettings, VLTrainer

        trainer_class, settings = VLTrainer, lambda a: _settings(a, VLSettings())
    else:
        given = [f"--{f.replace('_', '-')}" for f in VL_FLAGS if getattr(args, f, None) is not None]
        if given:
            print(f"k3 train: error: {' '.join(given)} applies to vision-language configs "
                  f"(--config k3-tiny-vl), not {args.config or _DEFAULTS.config}", file=sys.stderr)
            return 2
    done = train_verb("train", args, trainer_class, settings, (TrainError, DataError, ConfigError, ResumeStateError))
    if isinstance(done, int):
        return done
    trainer, result = done
    if "vqa" in result and trainer.world.is_main:
        v = result["vqa"]
        print(f"\nheld-out visual questions: {v['accuracy']:.1%} of {v['questions']} answered exactly "
              f"(text-only baselines: blank images {v['blank_image_accuracy']:.1%}, "
              f"majority answer {v['majority_accuracy']:.1%})")
    if trainer.world.is_main:
        run_dir = result["run_dir"]
        print(f"\nrun saved to {run_dir}\n"
              f"  val loss {result['val_loss']:.4f} nats/token, {result['val_bpb']:.4f} bits/byte "
              f"({result['val_tokens']:,} val tokens), {result['elapsed'] / 60:.1f} min\n"
              f"  checkpoint {result['checkpoint']}\n"
              f"  report {run_dir}/report.md, loss curve {run_dir}/loss.png, metrics {run_dir}/metrics.jsonl\n"
              + (f"  try: k3 chat --run {run_dir}  (then /image scene.png, and ask about it)" if "vqa" in result else
                 f"  try: k3 generate --run {run_dir} --prompt \"To be, or not to be\""))
    return 0
