"""Parameter accounting (DESIGN §10); the `k3 params` verb is k3/params_cli.py.

Convention (stated, and printed by the tool):
- total   = every tensor of the text model at its unquantized shape (vision encoder excluded);
- active  = total - the routed experts a token does not use ((E - k) / E of each MoE layer's
            routed experts) - the input embedding table (a lookup, not a matmul); lm_head counts.
The model is built on the meta device, so the official 2.78T config counts in seconds.
A config with a `vision_config` (the published multimodal one) also counts the vision encoder, tower
and projector apart (DESIGN §7), outside the text total.
"""
from __future__ import annotations

import re
from collections import OrderedDict

import torch

from k3.config import K3Config

COMPONENTS = ["embedding", "kda", "mla", "attnres", "dense_ffn", "shared_experts", "routed_experts",
              "latent_projections", "router", "norms", "lm_head"]


def component_of(name: str, config: K3Config) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "_res_proj" in name or "_res_norm" in name:
        return "attnres"
    if ".self_attn." in name:
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
        return "mla" if config.is_mla_layer(layer) else "kda"
    if ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared_experts"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent_projections"
    if ".mlp." in name:
        return "dense_ffn"
    if "layernorm" in name or name == "model.norm.weight":
        return "norms"
    raise ValueError(f"parameter {name!r} belongs to no known component")


def count_parameters(config: K3Config) -> dict:
    from k3.model.transformer import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    by_component = OrderedDict((c, 0) for c in COMPONENTS)
    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied lm_head counts once
            continue
        seen.add(id(tensor))
        by_component[component_of(name, config)] += tensor.numel()
    total = sum(by_component.values())
    unused_fraction = 1 - config.num_experts_per_token / config.num_experts if config.num_experts else 0.0
    inactive_routed = round(by_component["routed_experts"] * unused_fraction)
    active = total - inactive_routed - by_component["embedding"]
    return {
        "total": total,
        "active": active,
        "components": dict(by_component),
        "convention": "total: all text-model tensors unquantized; active: total minus unselected routed "
                      "experts ((E-k)/E per MoE layer) minus the input embedding (lm_head counted)",
    }


def count_vision_parameters(vision_config) -> dict:
    """Parameters of the vision encoder (k3/model/vision/): the MoonViT tower, the mm projector and
    their sum (no buffer counts: the temporal table is computed, not trained)."""
    from k3.model.vision import VisionModel

    with torch.device("meta"):
        model = VisionModel(vision_config)
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    return {"vision_tower": tower, "mm_projector": projector, "total": tower + projector}
