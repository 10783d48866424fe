"""Page geometry: how MLA latent blocks and KDA state snapshots map onto equal-size pages (DESIGN §11).

One page size for both cache kinds:
- An MLA page holds `block_size` tokens of the cached latent (kv_lora_rank + qk_rope_head_dim,
  DESIGN §4) for ALL MLA layers at once: every token writes every MLA layer, so the layers share one
  lifetime, one page table and one refcount per block of tokens; a per-layer page could only ever
  be evicted together with its siblings anyway.
- A KDA snapshot of ONE layer (recurrent state [H, K, V] fp32 then the conv tails [3C, W-1] in the
  model dtype, DESIGN §3) spans `pages_per_snapshot` pages; a checkpoint is one snapshot per KDA
  layer. Snapshots are per layer so that the pool can evict them page by page, which is why
  evicting one layer's snapshot must invalidate its siblings (prefix_cache.py).
The running state of a request is stored the same way in private pages (one snapshot per layer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3.config import K3Config


@dataclass(frozen=True)
class PageLayout:
    block_size: int  # tokens per MLA page
    num_mla_layers: int
    cache_width: int  # K3Config.mla_cache_width: latent + rope key per token
    num_kda_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_channels: int  # 3C: q|k|v short-conv channels
    conv_tail: int  # W-1
    dtype: torch.dtype  # model dtype (latents, conv tails); the recurrent state is fp32

    @classmethod
    def from_config(cls, config: K3Config, block_size: int, dtype: torch.dtype = torch.float32) -> PageLayout:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"pages hold fp32/bf16/fp16 model state, got {dtype}")
        return cls(block_size=block_size, num_mla_layers=config.num_mla_layers,
                   cache_width=config.mla_cache_width,
                   num_kda_layers=config.num_kda_layers, kda_heads=config.kda_num_heads,
                   kda_head_dim=config.kda_head_dim,
                   conv_channels=3 * config.kda_num_heads * config.kda_head_dim,
                   conv_tail=config.short_conv_kernel_size - 1, dtype=dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def recurrent_bytes(self) -> int:
        return self.kda_heads * self.kda_head_dim * self.kda_head_dim * 4

    @property
    def snapshot_bytes(self) -> int:
        """One KDA layer's state; the fp32 part first keeps the dtype part aligned."""
        return self.recurrent_bytes + self.conv_channels * self.conv_tail * self.itemsize

    @property
    def page_bytes(self) -> int:
        if self.num_mla_layers == 0:  # a pure-KDA model: a page is one snapshot
            return self.snapshot_bytes
        return self.block_size * self.num_mla_layers * self.cache_width * self.itemsize

    @property
    def pages_per_snapshot(self) -> int:
        return math.ceil(self.snapshot_bytes / self.page_bytes) if self.num_kda_layers else 0

    @property
    def pages_per_state(self) -> int:
        """Pages of a full KDA state (all layers): a request's private state or a checkpoint."""
        return self.num_kda_layers * self.pages_per_snapshot

    @property
    def replay_bytes_per_token(self) -> int:
        """What a verified token keeps for a KDA rollback by replay, over all KDA layers (DESIGN §11;
        `k3.model.cache.KDAInputs`): the pre-conv q|k|v inputs, k and v after the conv and the
        raw gate (model dtype), and beta (fp32) — against a snapshot per drafted position."""
        C = self.kda_heads * self.kda_head_dim
        return self.num_kda_layers * ((self.conv_channels + 3 * C) * self.itemsize + self.kda_heads * 4)

    def mla_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size) if self.num_mla_layers else 0
