"""The K3 text model: decoder layers, Block AttnRes bookkeeping, the LM head (DESIGN §2, §5).

Legend: B batch, T tokens, D hidden, V vocab. Module and parameter names are the official
checkpoint's (`model.layers.{i}.self_attn...`, `model.output_attn_res_proj`, `lm_head`), so the
checkpoint table in k3/checkpoint/official.py is a prefix, not a rename of every tensor.

Sequences travel either as a uniform batch [B, T] or packed into one row with `cu_seqlens`
(documents never share state). Padded batches (`attention_mask`) are unpadded into the packed
form and padded back, so no layer ever sees a pad token: left and right padding are the same.
"""
from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.attnres import BlockSource, attn_res_read, new_attn_res_pair
from k3.model.cache import K3Cache
from k3.model.fusion import fuse_projections
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import StableLatentMoE
from k3.model.norm import RMSNorm
from k3.model.pretrained import Pretrained
from k3.model.situ import DenseMLP
from k3.ops import host_free


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, eps = config.hidden_size, config.rms_norm_eps
        self.is_mla = config.is_mla_layer(layer_idx)
        self.self_attn = GatedMLA(config, layer_idx) if self.is_mla else KimiDeltaAttention(config, layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = StableLatentMoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config)
        if config.attn_res_block_size is not None:
            self.self_attention_res_proj, self.self_attention_res_norm = new_attn_res_pair(D, eps)
            self.mlp_res_proj, self.mlp_res_norm = new_attn_res_pair(D, eps)
            self.attn_res_read = attn_res_read  # k3.regional_compile swaps in a compiled read

    def mixer(self, h: torch.Tensor, cu_seqlens, state) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), cu_seqlens=cu_seqlens, state=state)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, h: torch.Tensor, blocks: list[BlockSource] | None = None, cu_seqlens=None, state=None):
        """One layer. Plain pre-norm residual when the model has no AttnRes (`blocks` is None);
        otherwise the Block AttnRes bookkeeping of DESIGN §5: `h` is the running `prefix` (the partial
        sum of the current block), returned updated, and `blocks` grows when this layer opens a
        block. One entry point, so FSDP2 units and activation checkpointing wrap whole layers."""
        if blocks is None:
            h = h + self.mixer(h, cu_seqlens, state)
            return h + self.ffn(h)
        prefix = h
        h = prefix if not blocks else self.attn_res_read(prefix, blocks, self.self_attention_res_proj,
                                                          self.self_attention_res_norm)
        a = self.mixer(h, cu_seqlens, state)
        if self.layer_idx % self.config.attn_res_block_size == 0:  # this layer opens a new block
            blocks.append(BlockSource(prefix, self.config.rms_norm_eps))
            prefix = a
        else:
            prefix = prefix + a
        h = self.attn_res_read(prefix, blocks, self.mlp_res_proj, self.mlp_res_norm)
        return prefix + self.ffn(h)


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_proj, self.output_attn_res_norm = new_attn_res_pair(config.hidden_size,
                                                                                     config.rms_norm_eps)
            self.attn_res_read = attn_res_read

    def forward(self, input_ids: torch.Tensor | None, cu_seqlens=None, cache: K3Cache | None = None,
                depth_taps: list | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] (or `inputs_embeds` [B, T, D] in its place) -> final hidden states [B, T, D] (after
        the last norm). `depth_taps`, a list:
        filled with the representations along depth [B, T, D] (fp32): the AttnRes sources (the
        embedding, then each finished block) and the last block's sum, or without AttnRes the
        residual stream after each layer (what a speculative draft reads, DESIGN §12.5)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        states = cache.layers if cache is not None else [None] * len(self.layers)
        blocks: list[BlockSource] | None = None if self.config.attn_res_block_size is None else []
        for layer, state in zip(self.layers, states):
            h = layer(h, blocks, cu_seqlens, state)
            if depth_taps is not None and blocks is None:
                depth_taps.append(h.float())
        if blocks is not None:
            if depth_taps is not None:
                depth_taps += [b.value for b in blocks] + [h.float()]
            h = self.attn_res_read(h, blocks, self.output_attn_res_proj, self.output_attn_res_norm)
        return self.norm(h)


class K3ForCausalLM(Pretrained, nn.Module):
    """The K3 text model and its LM head; `from_pretrained` / `save_pretrained` as k3/checkpoint reads and writes."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.lm_head.weight.device.type != "meta":  # meta builds (counting, loading) need no init
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) for matrices and embeddings, ones for norms, each mixer's
        and MoE's own rules for their special parameters; AttnRes pseudo-queries stay ZERO so every
        read starts as the uniform average (DESIGN §5)."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    nn.init.zeros_(module.weight)
                else:
                    nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        for module in self.modules():
            if isinstance(module, (KimiDeltaAttention, StableLatentMoE)):
                module.reset_parameters()

    def fuse_projections(self) -> list[str]:
        """For inference: each mixer's projections of its input as one GEMM in forwards without
        autograd, names, values and memory unchanged (k3.model.fusion); one line per kind of layer."""
        return fuse_projections(self)

    def forward(self, input_ids: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                cache: K3Cache | None = None, attention_mask: torch.Tensor | None = None,
                logits_to_keep: torch.Tensor | None = None, hidden_out: list | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in fp32.

        inputs_embeds [B, T, D], instead of input_ids: the embedded tokens as they enter layer 0 (the
        multimodal model's image rows in place of placeholders, k3/model/multimodal.py; DESIGN §7).

        cu_seqlens [N+1] (B == 1): packed documents. cache: N sequences continued in place
        (N = B, or len(cu_seqlens) - 1). attention_mask [B, T] (1 = token): padded rows; pad
        positions get zero logits. logits_to_keep [P] (positions along T, as HF's tensor form):
        logits [B, P, V] of those positions only; a serving step samples from one position per
        sequence, and a [T, V] fp32 prefill logit tensor is the largest thing it would write.
        hidden_out (a list; packed or uniform rows): gets the final hidden states [B, T, D] of every
        position, then the depth taps of `K3Model.forward` (a speculative draft's inputs)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [batch, tokens] and inputs_embeds [batch, tokens, hidden]")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be [batch, tokens, {self.config.hidden_size}], "
                             f"got shape {tuple(inputs_embeds.shape)}")
        tokens = input_ids if inputs_embeds is None else inputs_embeds  # [B, T] or [B, T, D]
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("pass either attention_mask (padded rows) or cu_seqlens (packed rows), not both")
            if logits_to_keep is not None or hidden_out is not None:
                raise ValueError("logits_to_keep and hidden_out are for packed or uniform rows, not padded ones")
            return self._forward_padded(tokens, attention_mask, cache)
        if cu_seqlens is not None and tokens.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs a single packed row, got batch {tokens.shape[0]}")
        num_seqs = tokens.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and cache.num_seqs != num_seqs:
            raise ValueError(f"cache holds {cache.num_seqs} sequences, the batch has {num_seqs}")
        # host-free (a captured serving step, k3.ops.host_free): the caller sized the buffers and
        # keeps the host lengths; reading the new lengths here would synchronize
        counting = cache is not None and not host_free.active()
        if counting:
            new_tokens = (cu_seqlens.diff().cpu() if cu_seqlens is not None
                          else torch.full((num_seqs,), tokens.shape[1], dtype=torch.long))
            cache.reserve(new_tokens)
        taps = None if hidden_out is None else []
        hidden = self.model(input_ids, cu_seqlens, cache, taps, inputs_embeds)
        if hidden_out is not None:
            hidden_out += [hidden] + taps
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden).float()
        if counting:
            cache.lengths += new_tokens
        return logits

    def _forward_padded(self, tokens, attention_mask, cache):
        """tokens: input_ids [B, T] or inputs_embeds [B, T, D] (floating point)."""
        keep = attention_mask.bool()
        lengths = keep.sum(1)
        if (lengths == 0).any():
            raise ValueError("every row of attention_mask needs at least one real token")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=tokens.device)
        cu[1:] = lengths.cumsum(0)
        rows = {"inputs_embeds" if tokens.is_floating_point() else "input_ids": tokens[keep][None]}
        packed = self.forward(**rows, cu_seqlens=cu, cache=cache)[0]
        logits = packed.new_zeros(*keep.shape, packed.shape[-1])
        logits[keep] = packed
        return logits
