"""The published multimodal layout: K3ForConditionalGeneration to and from config.json + sharded
safetensors + model.safetensors.index.json (DESIGN §1, §7; docs/VISION.md).

Three name prefixes, as moonshotai/Kimi-K3 ships them: `language_model.` (the text model's official
names, routed experts split per expert: k3/checkpoint/official.py), `vision_tower.` and
`mm_projector.` (our module names are theirs, so those tensors are written and read as they are).
config.json is the `kimi_k3` one: `architectures` KimiK3ForConditionalGeneration, `text_config`
as the text writer writes it, `vision_config` as VisionConfig writes it. The writer and the reader
are official.py's (atomic files, index last; safetensors only, MXFP4-packed experts dequantized).
The text loader, `load_pretrained`, reads the same folder as a K3ForCausalLM (it skips vision).
Importing this module gives `K3ForConditionalGeneration` its `from_pretrained` / `save_pretrained`
(`from k3 import K3ForConditionalGeneration` does).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from k3.checkpoint.files import DEFAULT_SHARD_BYTES, INDEX_NAME, CheckpointMismatchError
from k3.checkpoint.official import official_to_state_dict, save_pretrained, state_dict_to_official
from k3.checkpoint.packed import pack_tensors, with_quantization_config
from k3.checkpoint.pretrained import as_dtype, assign_checkpoint, read_checkpoint
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.model.multimodal import K3ForConditionalGeneration, K3MultimodalConfig
from k3.model.precision import fp32_tensor_names
from k3.model.pretrained import register_format
from k3.model.vision.patch_embed import DividedFixedPosEmb, sincos_table

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
ARCHITECTURE = "KimiK3ForConditionalGeneration"


def multimodal_to_official(model: K3ForConditionalGeneration) -> dict[str, torch.Tensor]:
    """Every tensor of `model` under its official name: the text model's (prefixed, experts split)
    then the vision encoder's (already official)."""
    out = state_dict_to_official(model.language_model)
    out.update({name: t for name, t in model.state_dict().items() if name.startswith(VISION_PREFIXES)})
    return out


def save_pretrained_multimodal(model: K3ForConditionalGeneration, directory: str | Path, *,
                               max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write config.json, the shards and their index in the official multimodal layout."""
    config_dict = model.config.to_dict()
    config_dict["architectures"] = [ARCHITECTURE]  # the class that reads all three prefixes
    return save_pretrained(model.language_model, directory, max_shard_bytes=max_shard_bytes,
                           tensors=multimodal_to_official(model), config_dict=config_dict)


def save_packed_multimodal(model: K3ForConditionalGeneration, directory: str | Path, *,
                           dtype: torch.dtype | None = torch.bfloat16,
                           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """The published form of a multimodal checkpoint: the text model's routed experts MXFP4-packed
    and everything else, the vision tower and projector included, in `dtype` (bf16 as published;
    the published quantization_config ignores `vision_tower` and `mm_projector`). The readers
    dequantize the experts at load (k3/checkpoint/packed.py)."""

    text = model.language_model
    keep_fp32 = {text.config.checkpoint_prefix + name for name in fp32_tensor_names(text)}
    config_dict = with_quantization_config(model.config)
    config_dict["architectures"] = [ARCHITECTURE]
    return save_pretrained(text, directory, max_shard_bytes=max_shard_bytes, config_dict=config_dict,
                           tensors=pack_tensors(multimodal_to_official(model), dtype=dtype, keep_fp32=keep_fp32))


def is_multimodal_checkpoint(directory: str | Path) -> bool:
    """A multimodal checkpoint: `vision_tower.*` tensors beside a `vision_config`. The published
    config has a `vision_config` for text-only exports too, so the config alone does not say."""
    folder = Path(directory)
    try:
        if "vision_config" not in json.loads((folder / "config.json").read_text()):
            return False
        index = folder / INDEX_NAME
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(folder / "model.safetensors", "pt") as f:
                names = list(f.keys())
    except (OSError, ValueError, KeyError, TypeError):
        return False  # the loader reports the missing or broken file
    return any(name.startswith("vision_tower.") for name in names)


def load_pretrained_multimodal(directory: str | Path, *, device=None, dtype: torch.dtype | None = None,
                               config: K3MultimodalConfig | None = None) -> K3ForConditionalGeneration:
    """Build a K3ForConditionalGeneration from an official-layout folder (ours or the published
    one). Every tensor of the three prefixes must be present and no other: a mismatch is a
    CheckpointMismatchError naming them. fp32-by-design text tensors stay fp32 whatever `dtype` asks."""
    text_config, tensors = read_checkpoint(directory, dtype=dtype,
                                           config=None if config is None else config.text_config)
    config = config or K3MultimodalConfig.from_text_config(text_config)
    vision = {name: t for name, t in tensors.items() if name.startswith(VISION_PREFIXES)}
    if not vision:
        raise CheckpointMismatchError(f"checkpoint {directory} has no vision_tower. / mm_projector. tensors "
                                      f"(a text-only checkpoint: load it with load_pretrained)")
    # official_to_state_dict skips the vision tensors; it names the text ones as K3ForCausalLM does
    state = {"language_model." + name: t for name, t in official_to_state_dict(config.text_config, tensors).items()}
    state.update(vision)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config)
    assign_checkpoint(model, state, directory, device=device, dtype=dtype)
    if config.text_config.tie_word_embeddings:
        model.language_model.lm_head.weight = model.language_model.model.embed_tokens.weight
    for module in model.modules():  # non-persistent buffers are in no file: compute them where the weights went
        if isinstance(module, DividedFixedPosEmb):
            module.time_weight = sincos_table(*module.time_weight.shape).to(module.weight.device)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # a new non-persistent buffer the line above does not compute yet
        raise RuntimeError(f"tensors left unmaterialized after loading {directory}: {left[:8]}")
    return model


def from_pretrained_multimodal(cls, path: str | Path, *, dtype: torch.dtype | str | None = None,
                               device: torch.device | str | None = None) -> K3ForConditionalGeneration:
    """`K3ForConditionalGeneration.from_pretrained`: a checkpoint or run folder's multimodal model, in eval mode."""
    folder = resolve_checkpoint(path)
    device = None if device is None else torch.device(device)
    return load_pretrained_multimodal(folder, dtype=as_dtype(dtype), device=device).eval()


register_format(K3ForConditionalGeneration, from_pretrained_multimodal, save_pretrained_multimodal)
