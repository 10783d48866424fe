"""Decode-state containers: what a sequence carries between forward calls (DESIGN §3, §4).

N sequences, H heads, K key dim, V value dim, C = H*K conv channels, W conv width,
S the MLA buffer's capacity in tokens, L+R = kv_lora_rank + qk_rope_head_dim.
- KDA layer: the conv tails of the q/k/v short convolutions (the last W-1 *pre-conv* inputs,
  [N, 3C, W-1], q|k|v order) and the fp32 recurrent state [N, H, K, V] (fla's op layout).
- MLA layer: per sequence, the normalized latent c (kv_lora_rank) and the unrotated key slot
  k_pe (qk_rope_head_dim), concatenated, in one padded buffer [N, S, L+R] whose first
  lengths[n] rows belong to sequence n. Padded rather than one tensor per sequence so a decode
  step writes its rows in place and attends for every sequence in one batched product, with no
  host synchronization (what CUDA-graph replay needs); the serving engine fills it from pages.

The model reads these and writes them: in place under no_grad (decode), by replacing the tensors
when autograd is recording (training through a cache keeps its graph). `K3Cache.lengths` (CPU) is
the host's count of consumed tokens; `K3Cache.reserve` grows the MLA buffers before a forward.
Packed batches (cu_seqlens) and caches share the same sequence order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config

# MLA buffers grow in steps of this many tokens: a decode step reallocates once per step of
# growth, and attention reads at most this many unused rows per sequence.
MLA_CAPACITY_STEP = 256


@dataclass
class KDAInputs:
    """A forward's per-token KDA inputs, kept on request (`KDAState.record`) so the state can be
    rebuilt later for a prefix of the tokens from the state before them (speculative decoding's
    rollback, DESIGN §11): the pre-conv q|k|v projections [B, T, 3C] (for the conv tails), and
    the op's k and v after the conv [B, T, H, K|V], raw gate projections [B, T, H, K] and beta
    [B, T, H] (for the recurrence)."""
    conv_inputs: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    g_raw: torch.Tensor | None = None
    beta: torch.Tensor | None = None

    def take(self, index: torch.Tensor) -> KDAInputs:
        """The inputs of the tokens at `index` (positions along T)."""
        return KDAInputs(*(t[:, index] for t in (self.conv_inputs, self.k, self.v, self.g_raw, self.beta)))


@dataclass
class KDAState:
    conv: torch.Tensor  # [N, 3C, W-1], model dtype
    recurrent: torch.Tensor  # [N, H, K, V], fp32 always (DESIGN §3: keep the state in fp32)
    record: KDAInputs | None = None  # set: the next forward stores its per-token inputs here

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32) -> KDAState:
        c = config.kda_num_heads * config.kda_head_dim
        return cls(
            conv=torch.zeros(num_seqs, 3 * c, config.short_conv_kernel_size - 1, device=device, dtype=dtype),
            recurrent=torch.zeros(num_seqs, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim,
                                  device=device, dtype=torch.float32),
        )

    def select(self, index: torch.Tensor | list[int]) -> KDAState:
        return KDAState(self.conv[index].clone(), self.recurrent[index].clone())


@dataclass
class MLAState:
    buffer: torch.Tensor  # [N, S, L+R], model dtype; rows past lengths[n] must be finite: attention
    # masks them but still multiplies them by their zero weights (0 * NaN = NaN). Zeros where they
    # are made or read from pages; the decode slots also keep rows the model wrote for earlier requests.
    lengths: torch.Tensor  # [N] int64 on the buffer's device: rows in use per sequence

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32,
              capacity: int = 0) -> MLAState:
        width = config.mla_cache_width
        return cls(torch.zeros(num_seqs, capacity, width, device=device, dtype=dtype),
                   torch.zeros(num_seqs, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.buffer.shape[1]

    def rows(self, n: int) -> torch.Tensor:
        """[lengths[n], L+R]: sequence n's latents (a view; reads the length back to the host)."""
        return self.buffer[n, :int(self.lengths[n])]

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` rows per sequence (existing rows kept)."""
        if num_tokens <= self.capacity:
            return
        capacity = -(-num_tokens // MLA_CAPACITY_STEP) * MLA_CAPACITY_STEP
        grown = self.buffer.new_zeros(self.buffer.shape[0], capacity, self.buffer.shape[2])
        grown[:, :self.capacity] = self.buffer
        self.buffer = grown

    def select(self, index: list[int]) -> MLAState:
        return MLAState(self.buffer[index].clone(), self.lengths[index].clone())


class K3Cache:
    """Per-layer decode state for N sequences; `layers[i]` is a KDAState or an MLAState."""

    def __init__(self, layers: list[KDAState | MLAState], lengths: torch.Tensor):
        self.layers = layers
        self.lengths = lengths  # [N] tokens already consumed per sequence (int64, CPU)

    @classmethod
    def empty(cls, config: K3Config, num_seqs: int, device=None, dtype=torch.float32,
              capacity: int = 0) -> K3Cache:
        """`capacity`: MLA rows to allocate up front (a CUDA-graph decode needs them all before capture)."""
        layers = [
            MLAState.empty(config, num_seqs, device, dtype, capacity) if config.is_mla_layer(i)
            else KDAState.empty(config, num_seqs, device, dtype)
            for i in range(config.num_hidden_layers)
        ]
        return cls(layers, torch.zeros(num_seqs, dtype=torch.long))

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.numel())

    def reserve(self, new_tokens: torch.Tensor) -> None:
        """Room in every MLA buffer for `new_tokens` [N] (CPU) more tokens per sequence."""
        needed = int((self.lengths + new_tokens).max()) if self.num_seqs else 0
        for layer in self.layers:
            if isinstance(layer, MLAState):
                layer.reserve(needed)

    def select(self, index: list[int]) -> K3Cache:
        """A cache holding copies of the chosen sequences' states (in the given order)."""
        return K3Cache([layer.select(index) for layer in self.layers], self.lengths[index].clone())
