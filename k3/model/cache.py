"""Decode-state containers: what a sequence carries between forward calls (SPEC §3, §4).

N sequences, H heads, K key dim, V value dim, C = H*K conv channels, W conv width.
- KDA layer: the conv tails of the q/k/v short convolutions (the last W-1 *pre-conv* inputs,
  [N, 3C, W-1], q|k|v order) and the fp32 recurrent state [N, H, K, V] (fla's op layout).
- MLA layer: per sequence, the normalized latent c (kv_lora_rank) and the unrotated key slot
  k_pe (qk_rope_head_dim), concatenated: [S_n, kv_lora_rank + qk_rope_head_dim]. A list, so
  sequences of different lengths need no padding; the serving engine builds these from pages.

The model reads these and writes them in place: a forward with a cache continues every sequence.
Packed batches (cu_seqlens) and caches share the same sequence order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config


@dataclass
class KDAState:
    conv: torch.Tensor  # [N, 3C, W-1], model dtype
    recurrent: torch.Tensor  # [N, H, K, V], fp32 always (SPEC §3: keep the state in fp32)

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32) -> "KDAState":
        c = config.kda_num_heads * config.kda_head_dim
        return cls(
            conv=torch.zeros(num_seqs, 3 * c, config.short_conv_kernel_size - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(num_seqs, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim,
                                  device=device, dtype=torch.float32),
        )

    def select(self, index: torch.Tensor | list[int]) -> "KDAState":
        return KDAState(self.conv[index].clone(), self.recurrent[index].clone())


@dataclass
class MLAState:
    latents: list[torch.Tensor]  # per sequence [S_n, kv_lora_rank + qk_rope_head_dim]

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32) -> "MLAState":
        width = config.kv_lora_rank + config.qk_rope_head_dim
        return cls([torch.zeros(0, width, device=device, dtype=dtype) for _ in range(num_seqs)])

    def select(self, index: list[int]) -> "MLAState":
        return MLAState([self.latents[i] for i in index])


class K3Cache:
    """Per-layer decode state for N sequences; `layers[i]` is a KDAState or an MLAState."""

    def __init__(self, layers: list[KDAState | MLAState], lengths: torch.Tensor):
        self.layers = layers
        self.lengths = lengths  # [N] tokens already consumed per sequence (int64, CPU)

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32) -> "K3Cache":
        layers = [
            (MLAState if config.is_mla_layer(i) else KDAState).empty(config, num_seqs, device, dtype)
            for i in range(config.num_hidden_layers)
        ]
        return cls(layers, torch.zeros(num_seqs, dtype=torch.long))

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.numel())

    def select(self, index: list[int]) -> "K3Cache":
        """A cache holding copies of the chosen sequences' states (in the given order)."""
        return K3Cache([layer.select(index) for layer in self.layers], self.lengths[index].clone())
