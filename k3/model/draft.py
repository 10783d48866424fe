"""The speculative draft: one EAGLE-3-style layer over the target's depth representations
(DESIGN §12.5).

K3's release has no MTP head (`num_nextn_predict_layers = 0`), so the draft is a separate module
that reads the frozen target. At a position t the target gives three representations along depth:
low and mid (AttnRes blocks 1 and n/2: the sources Block AttnRes already keeps) and high (the final
hidden state the LM head reads). The draft fuses them (`fuse`, W_E3, initialized to [0, 0, I] so
it starts from the high one alone), joins the embedding of token t+1 and runs one decoder layer;
its normalized output goes through the target's own LM head (shared, not stored here) and predicts
token t+2. Unrolled, the draft's own output stands in for the fused target representation of the
next position, whose target forward has not run yet.

Why a KDA layer (not MLA): its state is a fixed [H, K, V] per sequence, so the draft needs no pages,
and follows its sequence through chunked prefill, prefix-cache hits and preemption like any
running state; a per-position rollback is never needed (the serving side advances it only over
verified tokens). An MLA draft would need its own paged latent cache over the whole context.

Legend: B batch, T tokens, D hidden.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention
from k3.model.norm import RMSNorm
from k3.model.situ import DenseMLP


def depth_features(hidden_out: list[torch.Tensor]) -> torch.Tensor:
    """`K3ForCausalLM.forward(hidden_out=...)`'s list -> [..., 3D]: low | mid | high. Low and mid
    are raw residual sums (their scale grows with depth): RMS-normalized without a weight; high is
    already the final norm's output."""
    high, taps = hidden_out[0], hidden_out[1:]
    low, mid = taps[min(1, len(taps) - 1)], taps[len(taps) // 2]
    D = high.shape[-1]
    return torch.cat([F.rms_norm(low, (D,)).to(high.dtype), F.rms_norm(mid, (D,)).to(high.dtype), high], dim=-1)


class EagleDraft(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        D, eps = config.hidden_size, config.rms_norm_eps
        self.fuse = nn.Linear(3 * D, D, bias=False)  # W_E3
        self.embed_norm = RMSNorm(D, eps)
        self.input_proj = nn.Linear(2 * D, D, bias=False)  # [embedding | fused] -> D
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = KimiDeltaAttention(config, 0)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = DenseMLP(D, config.intermediate_size, config)
        self.norm = RMSNorm(D, eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        D, std = self.config.hidden_size, self.config.initializer_range
        self.fuse.weight.zero_()
        self.fuse.weight[:, 2 * D:] = torch.eye(D)  # pass the high representation through (DESIGN §12.5)
        nn.init.normal_(self.input_proj.weight, 0.0, std)
        self.input_proj.weight[:, D:] += torch.eye(D)  # and carry it into the layer's residual stream
        self.self_attn.reset_parameters()
        self.mlp.reset_parameters()
        for norm in (self.embed_norm, self.input_layernorm, self.post_attention_layernorm, self.norm):
            norm.reset_parameters()

    def new_state(self, num_seqs: int, device=None, dtype=torch.float32) -> KDAState:
        return KDAState.empty(self.config, num_seqs, device, dtype)

    def forward(self, feature: torch.Tensor, token_embedding: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                state: KDAState | None = None) -> torch.Tensor:
        """feature [B, T, D] (fused target representation, or the draft's own previous output) and
        the next token's embedding [B, T, D] -> the draft's output [B, T, D] (normalized: the LM
        head's input, and the feature of an unrolled next step)."""
        x = self.input_proj(torch.cat([self.embed_norm(token_embedding), feature], dim=-1))
        h = x + self.self_attn(self.input_layernorm(x), cu_seqlens=cu_seqlens, state=state)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.norm(h)
