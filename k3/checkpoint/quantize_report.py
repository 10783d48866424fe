"""Per-layer MXFP4 quantization error of the routed experts (what `k3 quantize` reports).

For each MoE layer and each expert matrix kind (w1 gate, w3 up, w2 down), the relative error
RMSE(W - Q(W)) / RMSE(W) over all of that layer's experts together, plus the worst single
expert matrix; Q is the checkpoint quantizer (MXFP4, K3 ceil rule, DESIGN §9). Computed in fp64.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from k3.checkpoint.official import state_dict_to_official
from k3.quant.mx import fake_quantize
from k3.quant.targets import WEIGHT_FORMAT, WEIGHT_RULE, is_routed_expert_linear

_LAYER_AND_KIND = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.\d+\.(w[123])$")
KINDS = ("w1", "w3", "w2")


@torch.no_grad()
def quantization_report(model: nn.Module) -> list[dict]:
    """[{layer, experts, w1, w3, w2, worst, worst_name}, ...] in layer order, plus a final row
    with layer "all" pooling every expert matrix. Reads the per-expert official tensors."""
    sums = defaultdict(lambda: [0.0, 0.0])  # (layer, kind) -> [sum err^2, sum w^2]
    counts: dict[int, int] = defaultdict(int)
    worst: dict[int, tuple[float, str]] = {}
    for name, weight in state_dict_to_official(model).items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and is_routed_expert_linear(module)):
            continue
        layer, kind = _LAYER_AND_KIND.search(module).groups()
        layer = int(layer)
        w = weight.double()
        err2 = (w - fake_quantize(weight, WEIGHT_FORMAT, WEIGHT_RULE).double()).pow(2).sum().item()
        ref2 = w.pow(2).sum().item()
        for key in ((layer, kind), ("all", kind)):
            sums[key][0] += err2
            sums[key][1] += ref2
        counts[layer] += kind == "w1"
        rel = (err2 / max(ref2, 1e-300)) ** 0.5
        if rel > worst.get(layer, (-1.0, ""))[0]:
            worst[layer] = (rel, module)
    if not counts:
        raise ValueError("the model has no routed experts to quantize")
    rows = []
    for layer in sorted(counts) + ["all"]:
        row = {"layer": layer, "experts": counts[layer] if layer != "all" else sum(counts.values())}
        for kind in KINDS:
            err2, ref2 = sums[(layer, kind)]
            row[kind] = (err2 / max(ref2, 1e-300)) ** 0.5
        rel, name = max(worst.values()) if layer == "all" else worst[layer]
        row.update(worst=rel, worst_name=name)
        rows.append(row)
    return rows
