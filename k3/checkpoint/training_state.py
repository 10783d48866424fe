"""Training checkpoints: everything `--resume` needs to continue bit-for-bit, never pickled.

A checkpoint is a folder `step_{N:07d}/` under the run's `checkpoints/`:
    config.json, model-*.safetensors, model.safetensors.index.json   the model, HF layout, official
                                                                    names (k3.checkpoint.official)
    tokenizer.json, tokenizer_config.json                           so the folder loads on its own
    optimizer.safetensors                                           optimizer state, "state/<param>/<key>"
    trainer_state.json                                              step, data position, scheduler,
                                                                    param groups, run settings
    rng.safetensors                                                 torch RNG states
It is written into a hidden temp folder and renamed into place as the last act, so a folder named
`step_*` is always whole: a process killed mid-write leaves only a `.tmp` folder, which resume
ignores and the next save removes; a save that fails (a full disk) removes its temp folder at
once and raises CheckpointSaveError. The last `keep` checkpoints are kept; only the latest keeps
the resume state (optimizer, RNG, trainer state), older ones keep the model and tokenizer, unless
`keep_all_state` (the optimizer state is twice the model's size, and resume reads the latest).

State dicts come from torch.distributed.checkpoint's `get_*_state_dict(full_state_dict=True)`, the
same call for a plain module and an FSDP2-sharded one, so a checkpoint is unsharded and resumes
at any world size. Only rank 0 writes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from k3.checkpoint.files import read_safetensors
from k3.checkpoint.official import official_to_state_dict, save_pretrained, state_dict_to_official
from k3.checkpoint.run_folder import list_checkpoints

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
RESUME_FILES = (OPTIMIZER_FILE, RNG_FILE, TRAINER_STATE)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (e.g. no space left); names the folder and the cause."""


class ResumeStateError(ValueError):
    """A checkpoint without the state `--resume` needs (weights-only, or damaged)."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _full_options() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(ckpt_root: Path, step: int, model, optimizer, scheduler, trainer_state: dict,
                    write_extras, *, keep: int, keep_all_state: bool = False) -> Path:
    """Collective under torch.distributed (every rank calls it); rank 0 writes.
    `write_extras(folder)` adds files that are not training state (the tokenizer)."""
    model_sd = get_model_state_dict(model, options=_full_options())
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_full_options())
    final = ckpt_root / f"step_{step:07d}"
    if _rank0():
        tmp = ckpt_root / f".{final.name}.tmp"
        try:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            for stale in ckpt_root.glob(".step_*.tmp"):  # left by a process killed mid-write
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
            _write_checkpoint(tmp, step, model, model_sd, optim_sd, scheduler, trainer_state, write_extras)
        except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error type
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is only wasted space
            cause = getattr(e, "strerror", None) or e
            raise CheckpointSaveError(f"cannot save checkpoint {final}: {cause}") from None
        if final.exists():  # re-saving a step (resumed exactly at it): swap the old one out
            old = ckpt_root / f".{final.name}.old.tmp"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)  # the commit point
        kept = list_checkpoints(ckpt_root)
        for old in kept[:-keep]:
            shutil.rmtree(old)
        if not keep_all_state:
            for older in kept[-keep:-1]:
                for name in RESUME_FILES:
                    (older / name).unlink(missing_ok=True)
    _barrier()
    return final


def _write_checkpoint(tmp: Path, step: int, model, model_sd, optim_sd, scheduler, trainer_state: dict,
                      write_extras) -> None:
    # official names from the gathered (full) state dict, not from the possibly sharded module
    save_pretrained(model, tmp, tensors=state_dict_to_official(model, model_sd))
    write_extras(tmp)
    opt_tensors, groups = _flatten_optimizer(optim_sd)
    save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
    save_file(_rng_tensors(), str(tmp / RNG_FILE))
    state = dict(trainer_state, step=step, scheduler=scheduler.state_dict(), param_groups=groups)
    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")


def has_resume_state(folder: Path) -> bool:
    return all((folder / name).is_file() for name in RESUME_FILES)


def load_checkpoint(folder: Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG in place; returns the trainer state dict."""
    if not has_resume_state(folder):
        missing = [name for name in RESUME_FILES if not (folder / name).is_file()]
        raise ResumeStateError(f"{folder} has no {', '.join(missing)}: only the latest checkpoint of a run keeps "
                               f"the state to resume from")
    try:
        state = json.loads((folder / TRAINER_STATE).read_text())
        model_sd = official_to_state_dict(model.config, read_safetensors(folder))
        set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
        optim_sd = _unflatten_optimizer(load_file(str(folder / OPTIMIZER_FILE)), state["param_groups"])
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
        _restore_rng(load_file(str(folder / RNG_FILE)))
    # a damaged file (truncated, not JSON, missing a key or shard) or weights of another shape than
    # the run's config (an edited run.json) is the user's to fix: one line, never a traceback
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ResumeStateError(f"cannot resume from {folder}: {type(e).__name__}: {reason}") from None
    return state


def _flatten_optimizer(optim_sd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors = {}
    for name, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state/{name}/{key}"] = t.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
    return tensors, groups


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for key, t in tensors.items():
        _, rest = key.split("/", 1)
        name, field = rest.rsplit("/", 1)
        state.setdefault(name, {})[field] = t
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda")), key=lambda k: int(k[4:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
