"""The official MXFP4 checkpoint layout: compressed-tensors `mxfp4-pack-quantized` (DESIGN §1, §9).

Per routed-expert linear `...block_sparse_moe.experts.{e}.w{1,2,3}` (out x in):
    weight_packed  uint8 [out, in/2]    E2M1 nibbles, even element in the low nibble, bit 3 = sign
    weight_scale   uint8 [out, in/32]   E8M0 codes, e = ceil(log2(amax / 6)) (never saturates)
Every other tensor is bf16 (the fp32-by-design A_log, dt_bias and router bias stay fp32, as
`load_pretrained` keeps them), and config.json's `text_config.quantization_config` is the
published block. The layout is the one compressed-tensors' `pack_fp4_to_uint8` writes (its
`MXFP4PackedCompressor` registers this format name) and vLLM's `CompressedTensorsW4A16Mxfp4` reads:
both [out, in/2] uint8 weights and [out, in/32] uint8 scales, group 32, no global scale.

Loading mode: DEQUANTIZE AT LOAD. Every `X.weight_packed` / `X.weight_scale` pair becomes a dense
`X.weight` holding exactly the MXFP4 values (exact in bf16 and fp32), so the model code is the
ordinary one and a QAT-trained model serves with the very weights it trained with (k3/quant/qat.py
fake-quantizes with the same `mx.fake_quantize`). Memory is the dense size; a per-expert
dequantize-on-use module would be the place to save it.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from k3.checkpoint.files import DEFAULT_SHARD_BYTES, CheckpointError, read_json, read_safetensors
from k3.checkpoint.official import save_pretrained, state_dict_to_official
from k3.config import K3Config
from k3.model.precision import fp32_tensor_names
from k3.quant.mx import BLOCK, dequantize, quantize
from k3.quant.targets import WEIGHT_FORMAT, WEIGHT_RULE, is_routed_expert_linear

FORMAT = "mxfp4-pack-quantized"
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"

# The published `quantization_config` of moonshotai/Kimi-K3 (tests check it against the fixture).
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": FORMAT,
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                "symmetric": True, "type": "float", "zp_dtype": None,
            },
        }
    },
    "format": FORMAT,
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


class PackedCheckpointError(CheckpointError):
    """A checkpoint that claims the packed layout but does not follow it."""


# ------------------------------------------------------------------------------- tensors
def check_packable(tensors: dict[str, torch.Tensor]) -> None:
    """Every routed-expert matrix must split into MXFP4 blocks of 32 along its input dim; the first
    one that does not is a PackedCheckpointError naming it."""
    for name, t in tensors.items():
        if name.endswith(".weight") and is_routed_expert_linear(name.removesuffix(".weight")) and t.shape[-1] % BLOCK:
            raise PackedCheckpointError(
                f"{name} {tuple(t.shape)}: its input dim {t.shape[-1]} is not a multiple of {BLOCK}, the MXFP4 block; "
                f"the routed experts' sizes (moe_intermediate_size, routed_expert_hidden_size or hidden_size) "
                f"must be multiples of {BLOCK} to quantize")


def pack_tensors(tensors: dict[str, torch.Tensor], *, dtype: torch.dtype | None = torch.bfloat16,
                 keep_fp32: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Official-named dense tensors -> the packed layout: routed-expert weights become
    weight_packed / weight_scale, every other floating tensor is cast to `dtype` (None: kept),
    except the `keep_fp32` names."""
    check_packable(tensors)
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and is_routed_expert_linear(module):
            packed, scale = quantize(t.detach(), WEIGHT_FORMAT, WEIGHT_RULE)
            out[module + PACKED_SUFFIX], out[module + SCALE_SUFFIX] = packed, scale
        elif dtype is not None and t.is_floating_point() and name not in keep_fp32:
            out[name] = t.detach().to(dtype)
        else:
            out[name] = t.detach()
    return out


def unpack_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inverse of `pack_tensors` for the quantized tensors: each weight_packed / weight_scale pair
    becomes a dense `weight` in dtype (exact MXFP4 values); other tensors pass through."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) + PACKED_SUFFIX in tensors:
            continue
        if not name.endswith(PACKED_SUFFIX):
            out[name] = t
            continue
        module = name.removesuffix(PACKED_SUFFIX)
        scale = tensors.get(module + SCALE_SUFFIX)
        if scale is None:
            raise PackedCheckpointError(f"{name} has no {module + SCALE_SUFFIX}")
        if t.dtype != torch.uint8 or scale.dtype != torch.uint8 or t.dim() != 2 or scale.dim() != 2:
            raise PackedCheckpointError(f"{module}: weight_packed / weight_scale must be 2-D uint8, got "
                                        f"{t.dtype} {tuple(t.shape)} / {scale.dtype} {tuple(scale.shape)}")
        if scale.shape[0] != t.shape[0] or scale.shape[1] * 16 != t.shape[1]:
            raise PackedCheckpointError(f"{module}: weight_packed {tuple(t.shape)} (= [out, in/2]) and weight_scale "
                                        f"{tuple(scale.shape)} (= [out, in/32]) disagree")
        out[module + ".weight"] = dequantize(t, scale, WEIGHT_FORMAT, dtype)
    return out


# ------------------------------------------------------------------------------- config
def check_quantization_config(qc: dict) -> None:
    """Accept the MXFP4 pack format with 4-bit float weights in groups of 32; anything else is an error."""
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != FORMAT:
        raise PackedCheckpointError(f"unsupported quantization_config: quant_method {qc.get('quant_method')!r}, "
                                    f"format {qc.get('format')!r} (expected compressed-tensors / {FORMAT})")
    for gname, group in qc.get("config_groups", {}).items():
        w = group.get("weights") or {}
        if (group.get("format", FORMAT) != FORMAT or w.get("num_bits") != 4 or w.get("type") != "float"
                or w.get("group_size") != 32):
            raise PackedCheckpointError(f"quantization_config group {gname}: expected {FORMAT} with 4-bit float "
                                        f"weights in groups of 32, got {group}")


def with_quantization_config(config: K3Config) -> dict:
    """config.json dict carrying the published quantization_config (in text_config, as published)."""
    d = config.to_dict()
    d.get("text_config", d)["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    return d


def split_quantization_config(d: dict) -> tuple[dict, dict | None]:
    """config.json dict -> (the dict without quantization_config, that config or None)."""
    d = copy.deepcopy(d)
    qc = d.pop("quantization_config", None)
    if "text_config" in d:
        qc = d["text_config"].pop("quantization_config", qc)
    return d, qc


# ------------------------------------------------------------------------------- save / load
def save_packed(model, directory: str | Path, *, dtype: torch.dtype | None = torch.bfloat16,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Export `model` (plain or QAT) in the official MXFP4 layout. `dtype` is the dtype of the
    unquantized tensors: bf16 as published; None keeps the model's own (an exact export)."""
    keep_fp32 = {model.config.checkpoint_prefix + name for name in fp32_tensor_names(model)}
    tensors = pack_tensors(state_dict_to_official(model), dtype=dtype, keep_fp32=keep_fp32)
    return save_pretrained(model, directory, max_shard_bytes=max_shard_bytes, tensors=tensors,
                           config_dict=with_quantization_config(model.config))


def read_packed(directory: str | Path, *, dtype: torch.dtype | None = None) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """The dense config and the official-name tensors of a packed checkpoint (ours or the official
    one), routed experts dequantized to `dtype` (default: the embedding's dtype). The returned
    config has no `quantization_config`: the model it builds is dense, and saving it again must
    not claim packed weights. `k3.checkpoint.official.load_pretrained` builds the model from these."""
    directory = Path(directory)
    raw, qc = split_quantization_config(read_json(directory / "config.json"))
    if qc is None:
        raise PackedCheckpointError(f"{directory}/config.json has no quantization_config")
    check_quantization_config(qc)
    tensors = read_safetensors(directory)
    embed = next((t for n, t in tensors.items() if n.endswith("embed_tokens.weight")), None)
    expert_dtype = dtype or (embed.dtype if embed is not None else torch.bfloat16)
    return K3Config.from_dict(raw), unpack_tensors(tensors, expert_dtype)


def is_packed_checkpoint(directory: str | Path) -> bool:
    path = Path(directory) / "config.json"
    return path.is_file() and split_quantization_config(read_json(path))[1] is not None
