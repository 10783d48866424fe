"""Regional torch.compile for training: each layer's token mixer and FFN compiled on its own.

Why these regions and not whole decoder layers: a decoder layer's Block AttnRes bookkeeping
depends on its index (whether it opens a block, how many finished blocks it reads), so whole-layer
graphs would be re-traced for almost every layer. The mixers (KDA, gated MLA) and FFNs (Stable
LatentMoE, dense SiLU/SiTU-GLU) come in four kinds whose code is shared by every layer of a kind,
so each kind is traced once (parameters are graph inputs, not constants) and then reused; what
they fuse are the memory-bound pieces between the matmuls (norms, gates, activations, routing).
fla's Triton KDA kernels are opaque to the compiler (fla wraps them in `torch.compiler.disable`):
the KDA mixer compiles as the graph before and the graph after the kernel.
"""
from __future__ import annotations

from torch import nn

from k3.model.transformer import K3ForCausalLM


def compile_regions(model: K3ForCausalLM, backend: str = "inductor") -> list[nn.Module]:
    """Compile every layer's `self_attn` and FFN module in place; returns the compiled modules."""
    compiled = []
    for layer in model.model.layers:
        ffn = layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp
        for module in (layer.self_attn, ffn):
            module.compile(backend=backend)
            compiled.append(module)
    return compiled
