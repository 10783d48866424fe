"""Which tensors MX quantization touches (SPEC §9): the routed experts' linears only.

Attention (KDA and MLA), the latent down/up projections and their norm, shared experts, the router,
the dense layer-0 MLP, embeddings and lm_head stay high precision. Names are our module names
(= the official names without the `language_model.` prefix): `...block_sparse_moe.experts.{e}.w1`
(gate), `w3` (up), `w2` (down).
"""
from __future__ import annotations

import re

_ROUTED_EXPERT_LINEAR = re.compile(r"(^|\.)block_sparse_moe\.experts\.\d+\.w[123]$")


def is_routed_expert_linear(module_name: str) -> bool:
    return _ROUTED_EXPERT_LINEAR.search(module_name) is not None
