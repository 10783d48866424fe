"""Which tensors MX quantization touches and how (DESIGN §9): the routed experts' linears only.

Attention (KDA and MLA), the latent down/up projections and their norm, shared experts, the router,
the dense layer-0 MLP, embeddings and lm_head stay high precision. Names are the per-expert names
of the checkpoint files (`state_dict_to_official`; in memory the bank is stacked, k3/model/
experts.py): `...block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
"""
from __future__ import annotations

import re

from k3.quant.mx import E2M1, E4M3

# Routed-expert weights: MXFP4 with the K3 checkpoint rule e = ceil(log2(amax / 6)) — the packed
# checkpoint stores them so, and QAT trains on exactly these values.
WEIGHT_FORMAT, WEIGHT_RULE = E2M1, "ceil"
# Their inputs under QAT: MXFP8 E4M3 with the OCP floor rule, the on-the-fly activation cast of
# an MX GEMM (torchao's default); blocks run along the input (reduction) dim.
INPUT_FORMAT, INPUT_RULE = E4M3, "floor"
_ROUTED_EXPERT_LINEAR = re.compile(r"(^|\.)block_sparse_moe\.experts\.\d+\.w[123]$")


def is_routed_expert_linear(module_name: str) -> bool:
    return _ROUTED_EXPERT_LINEAR.search(module_name) is not None
