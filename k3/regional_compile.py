"""Regional torch.compile: each layer's token mixer and FFN compiled on its own, so are the
RMSNorms in front of them and the final norm, and the Block AttnRes reads (DESIGN §5) go through
one compiled function.

Why these regions and not whole decoder layers: a decoder layer's Block AttnRes bookkeeping
depends on its index (whether it opens a block, how many finished blocks it reads), so whole-layer
graphs would be re-traced for almost every layer. The mixers (KDA, gated MLA) and FFNs (Stable
LatentMoE, dense SiLU/SiTU-GLU) come in four kinds whose code is shared by every layer of a kind,
so each kind is traced once (parameters are graph inputs, not constants) and then reused; what
they fuse are the memory-bound pieces between the matmuls (norms, gates, activations, routing).
fla's Triton KDA kernels are opaque to the compiler (fla wraps them in `torch.compiler.disable`):
the KDA mixer compiles as the graph before and the graph after the kernel. The pre-norms sit
outside the mixer and FFN modules (the official layout), so they are regions of their own: eager,
each is five kernels (cast, square, mean, rsqrt, scale), in a k3-1b decode step some 250 of ~1,700.

The AttnRes reads are the other memory-bound part: in eager each read is a matrix-vector product
per source plus a multiply-add per source, all fp32 (2 reads per layer over up to 9 sources; in a
k3-1b decode step, 216 GEMVs and their split-K reductions take a fifth of the GPU time). One
function serves every read; it is traced once per number of sources, grad mode and kind of length
(the list's length is part of the graph), so the recompile limit must cover them all.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.model.attnres import attn_res_read
from k3.model.transformer import K3ForCausalLM


def compile_regions(model: K3ForCausalLM, backend: str = "inductor") -> list[nn.Module]:
    """Compile every layer's `self_attn` and FFN module, the RMSNorms in front of them and the final
    norm, and the AttnRes reads, in place; returns the compiled modules. Compiling happens lazily, at
    the first forward of each shape. A model compiled before keeps its compiled regions (a second
    engine over the same model reuses them), and dynamo's global recompile limit stays raised to
    what the AttnRes reads need."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:  # fail here, not at the first forward deep inside dynamo
        raise ValueError(f"unknown torch.compile backend {backend!r}; known: {', '.join(known)}")
    regions = [module for layer in model.model.layers
               for module in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                              layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp)]
    regions.append(model.model.norm)
    for module in regions:
        if module._compiled_call_impl is None:  # what nn.Module.compile sets
            module.compile(backend=backend)
    block_size = model.config.attn_res_block_size
    if block_size is not None and model.model.attn_res_read is attn_res_read:
        source_counts = -(-model.config.num_hidden_layers // block_size) + 1  # 1 .. blocks + 1 sources
        # traced per source count and, for each, per grad mode (with, without) x shape kind: the
        # first shape seen, then dynamic sizes (other lengths, other batch sizes), and length 1,
        # which dynamo always specializes (decode steps). Serving runs one grad mode, so its extra
        # batch-size variants fit in the other's share.
        limit = 2 * 3 * source_counts
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        read = torch.compile(attn_res_read, backend=backend)
        for owner in (*model.model.layers, model.model):
            owner.attn_res_read = read
    return regions
