"""HF-layout checkpoints: config.json + sharded safetensors + model.safetensors.index.json, with the
official tensor names (DESIGN §1: K3 `language_model.model.layers.{i}...`, Kimi Linear
`model.layers.{i}...`). Our module names ARE the official names, so the mapping is one prefix plus
two rules kept here: routed experts are stacked in memory (`experts.w1` [E, I, H]) and split per
expert in files (`experts.{e}.w1.weight`, k3/model/experts.py), and `_ALIASES` accepts the other
spellings transformers writes. Safetensors only: nothing is ever unpickled.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from k3.atomic import write_atomic, write_text_atomic
from k3.checkpoint.files import DEFAULT_SHARD_BYTES, INDEX_NAME, CheckpointMismatchError
from k3.config import K3Config

_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(w[123])$")
_EXPERT_FILE_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")

# Other spellings of official tensors, mapped to ours. transformers 5.24 writes Kimi-Linear
# checkpoints in the official layout (it splits its fused conv and expert tensors back on save)
# except for the dense layer-0 MLP, which it writes under `block_sparse_moe.` (DESIGN §6 note).
_ALIASES = [
    (re.compile(r"^(.*layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$"), r"\1mlp.\2"),
]


def state_dict_to_official(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (the model's own, or e.g. one gathered from FSDP shards) under the official
    names (tied lm_head dropped: safetensors stores no aliases)."""
    prefix = model.config.checkpoint_prefix
    out = {}
    for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        stacked = _STACKED_EXPERTS.match(name)
        if stacked:
            for e in range(tensor.shape[0]):
                out[f"{prefix}{stacked.group(1)}.{e}.{stacked.group(2)}.weight"] = tensor[e]
        else:
            out[prefix + name] = tensor
    return out


def official_to_state_dict(config: K3Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official (or transformers-written) names -> our state-dict names."""
    prefix = config.checkpoint_prefix
    out = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _ALIASES:
            name = pattern.sub(replacement, name)
        if prefix and not name.startswith(prefix):
            if name.startswith(("vision_tower.", "mm_projector.")):
                continue  # the vision encoder is not part of the text model
            raise CheckpointMismatchError(f"tensor {name!r} lacks the expected prefix {prefix!r}")
        out[name[len(prefix):]] = tensor
    out = _stack_experts(out)
    if config.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """experts.{e}.w1.weight (one per expert) -> experts.w1 [E, ...]; every expert must be present."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        m = _EXPERT_FILE_NAME.match(name)
        if m:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = tensor
        else:
            out[name] = tensor
    for name, per_expert in groups.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            missing = sorted(set(range(max(per_expert) + 1)) - set(per_expert))
            raise CheckpointMismatchError(f"{name}: experts {missing[:8]} missing from the checkpoint")
        out[name] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    return out


def save_pretrained(model, directory: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tensors: dict[str, torch.Tensor] | None = None, config_dict: dict | None = None) -> Path:
    """Write config.json, shards and the index. Each file goes through temp + rename and the index is
    written last, so a reader that finds the index finds every shard whole.
    `tensors` / `config_dict` override what is written (used by the MXFP4 exporter)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_to_official(model) if tensors is None else tensors
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_atomic(directory / fname, lambda p, s=shard: save_file(s, str(p), metadata={"format": "pt"}))
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    config_dict = model.config.to_dict() if config_dict is None else config_dict
    write_text_atomic(directory / "config.json", json.dumps(config_dict, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return directory
