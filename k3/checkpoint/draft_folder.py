"""A speculative draft on disk: `draft/` beside a run (or anywhere), holding `model.safetensors`
(the draft's own weights only: it shares the target's embedding and LM head) and `draft.json`
(the draft's config and the identity of the target it was trained on).

A draft only makes sense with its own target: same width and vocabulary, and the very embedding
and LM head it was trained through. `load_draft` checks all three against the model it will serve
with and refuses a mismatch in one line. The target's identity is a hash of its embedding and LM
head rows, rounded to bf16 so the same run served in fp32 or bf16 matches.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3.atomic import write_atomic, write_text_atomic
from k3.config import K3Config
from k3.model.draft import EagleDraft

WEIGHTS, META = "model.safetensors", "draft.json"
FORMAT = "k3-eagle-draft-v1"


class DraftError(ValueError):
    """A draft folder that is missing, unreadable or not for this model."""


def target_fingerprint(model) -> str:
    """sha256 of (a strided subset of) the target's embedding and LM-head rows in bf16."""
    h = hashlib.sha256()
    for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
        rows = weight.detach()[::max(1, weight.shape[0] // 512)]
        h.update(str(tuple(weight.shape)).encode())
        h.update(rows.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:32]


def save_draft(draft: EagleDraft, target, directory: str | Path, extra: dict | None = None) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
    write_atomic(directory / WEIGHTS, lambda tmp: save_file(tensors, str(tmp)))
    meta = {"format": FORMAT, "config": draft.config.to_dict(), "target": target_fingerprint(target),
            "vocab_size": target.config.vocab_size, "hidden_size": target.config.hidden_size, **(extra or {})}
    write_text_atomic(directory / META, json.dumps(meta, indent=2) + "\n")
    return directory


def load_draft(directory: str | Path, target) -> EagleDraft:
    """The draft in `directory`, on the target's device and dtype; DraftError (one line) if it
    is not a draft folder or not trained for `target`."""
    directory = Path(directory)
    if not (directory / META).is_file() or not (directory / WEIGHTS).is_file():
        raise DraftError(f"{directory} is not a draft folder (no {META} and {WEIGHTS}; `k3 train-draft` writes one)")
    try:
        meta = json.loads((directory / META).read_text())
        config = K3Config.from_dict(meta["config"])
    except (ValueError, KeyError, TypeError) as e:
        raise DraftError(f"{directory / META} is not a readable draft description ({e})") from None
    if meta.get("format") != FORMAT:
        raise DraftError(f"{directory / META}: unknown draft format {meta.get('format')!r}")
    mine = target.config
    if meta.get("vocab_size") != mine.vocab_size or meta.get("hidden_size") != mine.hidden_size:
        raise DraftError(f"the draft in {directory} is for a model with vocabulary {meta.get('vocab_size')} and width "
                         f"{meta.get('hidden_size')}, this one has {mine.vocab_size} and {mine.hidden_size}")
    if meta.get("target") != target_fingerprint(target):
        raise DraftError(f"the draft in {directory} was trained on another model (its embedding and LM head differ "
                         "from this one's): train one for this run with `k3 train-draft`")
    weight = next(target.parameters())
    draft = EagleDraft(config)
    try:
        draft.load_state_dict(load_file(str(directory / WEIGHTS)))
    except (RuntimeError, OSError) as e:
        raise DraftError(f"{directory / WEIGHTS} does not hold this draft's weights ({str(e).splitlines()[0]})") from None
    return draft.to(weight.device, weight.dtype).eval()
