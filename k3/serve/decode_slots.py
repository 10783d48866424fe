"""Decode slots: the cache every decode step (one new token per request) runs on, allocated once.

Why kept rather than built per batch: a serving batch changes every few steps (requests finish,
others end their prefill and join). A cache built per batch takes its CUDA graph with it at the
next change; on bench/serve.py's mixed workload a batch lasts only a few forwards, so graphs would
rarely replay. Here the decode state lives in tensors that stay:

  KDA conv tails [Lk, R, 3C, W-1] (model dtype) and states [Lk, R, H, K, V] (fp32, DESIGN §3),
  MLA latents [M, R, S, L+R'] with device lengths [M, R], host lengths [R];

and a step over N requests runs on the view of the first B >= N rows and C <= S latent columns
(`view`). A batch change refills rows (the runner gathers them from pages: `fill`), and the graph
captured for that (B, C) replays on whatever the rows hold. With graphs, B and C are rounded up to
powers of two (few shapes, so few captures; padding rows run with length 0 and their outputs are
dropped); eager, B = N and C the next multiple of MLA_CAPACITY_STEP (no wasted rows). Graphs
share one memory pool: they never run at once.

Legend: R rows allocated, S latent columns allocated, Lk KDA layers, M MLA layers.
"""
from __future__ import annotations

import torch

from k3.model.cache import MLA_CAPACITY_STEP, K3Cache, KDAState, MLAState
from k3.serve.decode_graph import CUDAGraphDecoder


class DecodeSlots:
    def __init__(self, model, cuda_graphs: bool):
        self.model = model
        config = model.config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.cuda_graphs = cuda_graphs
        self.num_layers = config.num_hidden_layers
        self.kda_layers = [i for i in range(self.num_layers) if not config.is_mla_layer(i)]
        self.mla_layers = [i for i in range(self.num_layers) if config.is_mla_layer(i)]
        empty = K3Cache.empty(config, 0, self.device, self.dtype)  # the per-row shapes, nothing held
        kda = [empty.layers[i] for i in self.kda_layers]
        mla = [empty.layers[i] for i in self.mla_layers]
        self._conv_shape = kda[0].conv.shape[1:] if kda else ()
        self._state_shape = kda[0].recurrent.shape[1:] if kda else ()
        self._latent_width = mla[0].buffer.shape[-1] if mla else 0
        self.rows = self.columns = 0
        self._allocate(0, 0)
        self.graphs: dict[tuple[int, int], CUDAGraphDecoder] = {}
        # the memory pool the live graphs share (the first capture's); None while there are none
        self._graph_pool = None
        # the requests whose state the first rows hold, in order (None: nothing that may be reused)
        self.holds: list | None = None

    def _allocate(self, rows: int, columns: int) -> None:
        kw = {"device": self.device}
        self.conv = torch.zeros(len(self.kda_layers), rows, *self._conv_shape, dtype=self.dtype, **kw)
        self.recurrent = torch.zeros(len(self.kda_layers), rows, *self._state_shape, dtype=torch.float32, **kw)
        self.latents = torch.zeros(len(self.mla_layers), rows, columns, self._latent_width, dtype=self.dtype, **kw)
        self.mla_lengths = torch.zeros(len(self.mla_layers), rows, dtype=torch.long, **kw)
        self.host_lengths = torch.zeros(rows, dtype=torch.long)
        self.rows, self.columns = rows, columns

    def shape_for(self, num_seqs: int, tokens: int) -> tuple[int, int]:
        """(B, C): the rows and latent columns a step over `num_seqs` requests runs on, where the
        longest holds `tokens` tokens after the step."""
        blocks = -(-tokens // MLA_CAPACITY_STEP)
        if not self.cuda_graphs:
            return num_seqs, blocks * MLA_CAPACITY_STEP
        return power_of_two(num_seqs), power_of_two(blocks) * MLA_CAPACITY_STEP

    def must_grow(self, rows: int, columns: int) -> bool:
        return rows > self.rows or (columns > self.columns and bool(self.mla_layers))

    def reserve(self, rows: int, columns: int) -> bool:
        """Make the storage hold (rows, columns); growing it (geometrically, so it happens rarely)
        drops what it held and every graph, which read the old tensors. Returns whether it grew."""
        if not self.must_grow(rows, columns):
            return False
        self.graphs.clear()
        # and their memory pool: PyTorch retires a private pool with its last graph, and a capture
        # into a retired pool's id fails an internal assert of the caching allocator ("use_count > 0"
        # at capture_begin, after a growth); the next capture makes a new one
        self._graph_pool = None
        self.holds = None
        self._allocate(_grown(self.rows, rows), _grown(self.columns, columns))
        return True

    def fill(self, lengths: list[int], conv: torch.Tensor, recurrent: torch.Tensor, latents: torch.Tensor) -> None:
        """Load N requests into the first rows: conv [Lk, N, 3C, W-1], recurrent [Lk, N, H, K, V],
        latents [N, >= max(lengths), M, L+R'], zeros past each request's length (MLAState's contract);
        conv / recurrent / latents None where the model has no such layer. Latent columns past those
        given keep what earlier fills and steps wrote there: the model's finite rows, or zeros.
        Rows past N get length 0: a padding row attends only to its own token."""
        n = len(lengths)
        if self.kda_layers:
            self.conv[:, :n] = conv
            self.recurrent[:, :n] = recurrent
        self.host_lengths.zero_()
        self.host_lengths[:n] = torch.tensor(lengths, dtype=torch.long)
        if self.mla_layers:
            columns = min(latents.shape[1], self.columns)
            self.latents[:, :n, :columns] = latents[:, :columns].permute(2, 0, 1, 3)
            self.mla_lengths.copy_(self.host_lengths.to(self.device).expand_as(self.mla_lengths))

    def view(self, rows: int, columns: int) -> K3Cache:
        """The cache of the first `rows` rows and `columns` latent columns (views: writes land in
        the slots)."""
        layers: list = [None] * self.num_layers
        for j, i in enumerate(self.kda_layers):
            layers[i] = KDAState(self.conv[j, :rows], self.recurrent[j, :rows])
        for m, i in enumerate(self.mla_layers):
            layers[i] = MLAState(self.latents[m, :rows, :columns], self.mla_lengths[m, :rows])
        return K3Cache(layers, self.host_lengths[:rows])

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, str]:
        """ids [N] -> (logits [N, V], how it ran: 'eager', 'graph_capture' or 'graph_replay'). The
        logits of a replay are overwritten by the next one: read them first."""
        rows, columns = shape
        if not self.cuda_graphs:
            return self.model(ids.view(-1, 1), cache=self.view(rows, columns))[:, 0], "eager"
        graph = self.graphs.get(shape)
        kind = "graph_replay"
        if graph is None:
            graph = CUDAGraphDecoder(self.model, self.view(rows, columns), warmup_steps=1, pool=self._graph_pool)
            self.graphs[shape] = graph
            self._graph_pool = graph.pool
            kind = "graph_capture"
        tokens = ids.new_zeros(rows)
        tokens[:ids.numel()] = ids
        return graph.step(tokens)[:ids.numel()], kind


def _grown(have: int, need: int) -> int:
    return have if need <= have else max(need, 2 * have)


def power_of_two(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): the rows and latent blocks of a graph's shape."""
    return 1 << max(n - 1, 0).bit_length()
