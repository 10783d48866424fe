"""HF-layout checkpoints: config.json + sharded safetensors + model.safetensors.index.json, with the
official tensor names (SPEC §1: K3 `language_model.model.layers.{i}...`, Kimi Linear
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
from safetensors import safe_open
from safetensors.torch import save_file

from k3.atomic import write_atomic, write_text_atomic
from k3.config import ConfigError, K3Config
from k3.model.precision import fp32_tensor_names

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, corrupted, not safetensors/JSON); the
    message names the file."""


class CheckpointMismatchError(CheckpointError, KeyError):
    """Tensors missing, unexpected or misnamed for the config. A KeyError (a name lookup failed) and a
    CheckpointError, so verbs report it like any bad checkpoint, without KeyError's quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(w[123])$")
_EXPERT_FILE_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")

# Other spellings of official tensors, mapped to ours. transformers 5.24 writes Kimi-Linear
# checkpoints in the official layout (it splits its fused conv and expert tensors back on save)
# except for the dense layer-0 MLP, which it writes under `block_sparse_moe.` (SPEC §6 note).
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


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, the index) as a dict, or CheckpointError naming it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF-layout directory (indexed shards or a single model.safetensors).
    A truncated or corrupted file is a CheckpointError naming it, never a parser traceback."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no {INDEX_NAME} or model.safetensors in {directory}")
    tensors = {}
    for fname in files:
        path = directory / fname
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {INDEX_NAME} but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors' SafetensorError derives from Exception only
            raise CheckpointError(f"{path} is not a readable safetensors file "
                                  f"(truncated or corrupted?): {e}") from None
    return tensors


def load_pretrained(directory: str | Path, *, device=None, dtype: torch.dtype | None = None,
                    config: K3Config | None = None, model_class=None):
    """Build a K3ForCausalLM from an HF-layout directory: ours, the official layout (incl. the
    MXFP4 `mxfp4-pack-quantized` routed experts, dequantized at load by k3/quant), or one written by
    transformers' KimiLinearForCausalLM. Every parameter must be present: missing or unexpected
    tensors are an error naming them. fp32-by-SPEC tensors stay fp32 whatever `dtype` asks.
    `model_class` (default `k3.K3ForCausalLM`, k3/checkpoint/pretrained.py) is the class built;
    `K3ForCausalLM.from_pretrained` is this function."""
    from k3.checkpoint.pretrained import K3ForCausalLM

    model_class = model_class or K3ForCausalLM
    config, tensors = read_checkpoint(directory, dtype=dtype, config=config)
    tensors = official_to_state_dict(config, tensors)
    with torch.device("meta"):
        model = model_class(config)
    assign_checkpoint(model, tensors, directory, device=device, dtype=dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def read_checkpoint(directory: str | Path, *, dtype: torch.dtype | None = None,
                    config: K3Config | None = None) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """The text config (`config` if given, else config.json's) and every tensor of an HF-layout
    directory under its file name, MXFP4-packed experts dequantized (to `dtype` if given)."""
    from k3.checkpoint.packed import is_packed_checkpoint, read_packed

    directory = Path(directory)
    try:
        if is_packed_checkpoint(directory):
            packed_config, tensors = read_packed(directory, dtype=dtype)
            return config or packed_config, tensors
        if config is None:
            if not (directory / "config.json").is_file():
                raise FileNotFoundError(f"no config.json in {directory}")
            try:
                config = K3Config.from_dict(read_json(directory / "config.json"))
            except (KeyError, TypeError) as e:
                raise CheckpointError(f"{directory / 'config.json'} is not a model config ({e})") from None
        return config, read_safetensors(directory)
    except ConfigError as e:  # malformed or self-contradicting fields: the message names them
        raise ConfigError(f"{directory / 'config.json'}: {e}") from None


def assign_checkpoint(model, tensors: dict[str, torch.Tensor], directory: str | Path, *, device=None,
                      dtype: torch.dtype | None = None) -> None:
    """Fill a meta-built `model` with `tensors` (its own state-dict names): every name present and
    no other, shapes equal; fp32-by-SPEC tensors stay fp32 whatever `dtype` asks."""
    expected = set(model.state_dict().keys())
    fp32 = fp32_tensor_names(model)
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise CheckpointMismatchError(f"checkpoint {directory} does not match the config: missing {sorted(missing)[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}, unexpected {sorted(unexpected)[:8]}"
                       f"{' ...' if len(unexpected) > 8 else ''}")
    state = {}
    for name, ref in model.state_dict().items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(ref.shape)}")
        target = torch.float32 if name in fp32 else (t.dtype if dtype is None else dtype)
        state[name] = t.to(device=device, dtype=target)
    model.load_state_dict(state, assign=True, strict=True)
