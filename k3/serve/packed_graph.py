"""Packed serving steps (prompt chunks, with or without decode rows) replayed from CUDA graphs.

An eager packed forward is host-bound (docs/LOG.md "Serving engine": ~26 ms of host time for
~4 ms of kernels). Here it runs in host-free mode (k3/ops/host_free.py) on static buffers of a
bucketed shape, is captured once per shape and replayed:

- the row: the step's tokens padded to a bucket; the pad tokens are one more document, on a
  scratch cache row (the last), so whatever they write is never read;
- the documents: the step's requests, one-token ones (decode rows) first, then zero-length
  documents up to a power of two of rows;
- MLA's hints: `decode_rows` (rounded down to a power of two; the rest join the grid) and
  `chunk` (the longest other document or the padding, bucketed) fix its attention shapes;
- the cache: KDA states and MLA latents copied into static rows (the runner reads them from
  pages), lengths on the device, MLA columns bucketed; logits at a fixed count of kept positions.

A shape's first step runs eagerly in host-free mode (it warms kernels and fla's autotuning), its
second is captured, later ones replay. Off CUDA, or with `capture=False`, every step runs the same
host-free body eagerly: what the CPU tests compare with the plain packed forward.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from k3.model.cache import MLA_CAPACITY_STEP, K3Cache
from k3.ops.host_free import check_chunk, host_free
from k3.serve.decode_slots import power_of_two

MAX_GRAPHS = 32  # shapes captured per engine; steps of further shapes run host-free eagerly
MAX_TOKENS = 8192  # longer rows run the plain packed forward (MLA's query grid grows with chunk x columns)


def bucket(n: int, per_doubling: int = 4) -> int:
    """n rounded up to a multiple of a `per_doubling`-th of the next power of two (<= 1/per_doubling padding)."""
    step = max(1, (1 << max(0, n - 1).bit_length()) // per_doubling)
    return -(-n // step) * step


def _pow2_floor(n: int) -> int:
    return 0 if n <= 0 else 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class PackedShape:
    tokens: int  # the padded row
    rows: int  # documents = cache rows: the requests, zero-length ones, the scratch row last
    decode_rows: int  # the first documents with one token each that MLA batches
    chunk: int  # at most this many tokens in any other document
    columns: int  # MLA buffer capacity per row
    keep: int  # kept logit positions


def packed_shape(new: list[int], past: list[int], keep: int) -> PackedShape:
    """The bucketed shape of a step whose requests (decode rows first) add `new` tokens to `past`."""
    total = sum(new)
    tokens = bucket(total + 1)  # at least one pad token: the scratch document is never empty
    decode = _pow2_floor(sum(1 for n in new if n == 1))
    rest = [*new[decode:], tokens - total]
    columns = power_of_two(-(-max(p + n for p, n in zip(past, new)) // MLA_CAPACITY_STEP)) * MLA_CAPACITY_STEP
    columns = max(columns, power_of_two(tokens - total))  # the scratch row holds the pad tokens
    return PackedShape(tokens, power_of_two(len(new) + 1), decode, power_of_two(max(rest)), columns, power_of_two(max(keep, 1)))


class _Static:
    """One shape's input buffers and graph; the cache rows are shared by shapes of equal rows and columns."""

    def __init__(self, shape: PackedShape, cache: K3Cache, device: torch.device, pad_id: int):
        self.shape, self.cache = shape, cache
        self.ids = torch.full((1, shape.tokens), pad_id, dtype=torch.long, device=device)
        self.cu = torch.full((shape.rows + 1,), shape.tokens, dtype=torch.long, device=device)
        self.keep = torch.zeros(shape.keep, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.warm = False


class PackedGraphs:
    def __init__(self, model, *, capture: bool = True, log=None):
        self.model = model
        config = model.config
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.kda_layers = [i for i in range(config.num_hidden_layers) if not config.is_mla_layer(i)]
        self.mla_layers = [i for i in range(config.num_hidden_layers) if config.is_mla_layer(i)]
        self.capture = capture and self.device.type == "cuda"
        self.log = log or (lambda msg: None)
        self.statics: dict[PackedShape, _Static] = {}
        self.caches: dict[tuple[int, int], K3Cache] = {}
        self.stream = torch.cuda.Stream(self.device) if self.capture else None
        self.pool = None  # the graphs' shared memory pool: they never run at once
        self.capture_error: str | None = None
        self.counts = {"eager": 0, "capture": 0, "replay": 0}

    def fits(self, new: list[int]) -> bool:
        return sum(new) < MAX_TOKENS

    def _cache(self, rows: int, columns: int) -> K3Cache:
        key = (rows, columns)
        if key not in self.caches:
            self.caches[key] = K3Cache.empty(self.model.config, rows, self.device, self.dtype, capacity=columns)
        return self.caches[key]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, new: list[int], past: list[int], conv, recurrent, latents,
                keep: list[int]) -> tuple[torch.Tensor, K3Cache, list[int]]:
        """One packed step: `ids` [T] (device) of the requests' chunks in order, `new` / `past` their
        new and cached token counts, their states as the runner reads them from pages (conv
        [Lk, N, 3C, W-1], recurrent [Lk, N, H, K, V], latents [N, S, M, W]; None without such
        layers), `keep` the row positions whose logits are wanted. Returns (logits [len(keep), V],
        the static cache holding every request's state after the step, each request's row in it)."""
        n = len(new)
        order = [i for i in range(n) if new[i] == 1] + [i for i in range(n) if new[i] != 1]
        row_of = [0] * n
        for r, i in enumerate(order):
            row_of[i] = r
        shape = packed_shape([new[i] for i in order], [past[i] for i in order], len(keep))
        static = self.statics.get(shape)
        if static is None:
            static = self.statics[shape] = _Static(shape, self._cache(shape.rows, shape.columns), self.device,
                                                   self.pad_id)
        self._load(static, ids, new, past, order, row_of, conv, recurrent, latents, keep)
        logits = self._run(static)
        return logits[:len(keep)], static.cache, row_of

    def _load(self, static: _Static, ids, new, past, order, row_of, conv, recurrent, latents, keep) -> None:
        shape, n, total = static.shape, len(new), sum(new)
        starts = [0, *itertools.accumulate(new)]
        ordered = [0, *itertools.accumulate(new[i] for i in order)]
        bounds = ordered + [total] * (shape.rows - n - 1) + [shape.tokens]  # zero-length documents, the scratch one
        check_chunk(bounds, shape.chunk, shape.decode_rows)
        if order == list(range(n)):  # decode rows already first (the scheduler's usual order)
            static.ids[0, :total] = ids
        else:  # each request's tokens, in the static row's order: vectorized, not per token
            lengths = torch.tensor([new[i] for i in order])
            first = torch.tensor([starts[i] for i in order]).repeat_interleave(lengths)
            offset = torch.arange(total) - torch.tensor(ordered[:-1]).repeat_interleave(lengths)
            static.ids[0, :total] = ids[(first + offset).to(self.device)]
        static.ids[0, total:] = self.pad_id
        static.cu.copy_(torch.tensor(bounds, dtype=torch.long), non_blocking=True)
        # a kept position p (request i's token p - starts[i]) in the static row
        owner = [bisect.bisect_right(starts, p) - 1 for p in keep]
        kept = [ordered[row_of[i]] + p - starts[i] for p, i in zip(keep, owner)] + [0] * (shape.keep - len(keep))
        static.keep.copy_(torch.tensor(kept, dtype=torch.long), non_blocking=True)
        rows = torch.tensor(order, device=self.device)
        cache = static.cache
        for j, i in enumerate(self.kda_layers):
            state = cache.layers[i]
            state.conv[:n] = conv[j, rows]
            state.recurrent[:n] = recurrent[j, rows]
            state.conv[n:] = 0
            state.recurrent[n:] = 0
        lengths = torch.zeros(shape.rows, dtype=torch.long)
        lengths[:n] = torch.tensor([past[i] for i in order])
        on_device = lengths.to(self.device)
        for m, i in enumerate(self.mla_layers):
            state = cache.layers[i]
            held = min(latents.shape[1], shape.columns)
            state.buffer[:n, :held] = latents[rows, :held, m]
            state.lengths.copy_(on_device)
        cache.lengths.copy_(lengths)

    def _step(self, static: _Static) -> torch.Tensor:
        with host_free(chunk=static.shape.chunk, decode_rows=static.shape.decode_rows):
            return self.model(static.ids, cu_seqlens=static.cu, cache=static.cache, logits_to_keep=static.keep)[0]

    def _run(self, static: _Static) -> torch.Tensor:
        if static.graph is not None:
            static.graph.replay()
            self.counts["replay"] += 1
            return static.logits
        captured = sum(s.graph is not None for s in self.statics.values())
        if not self.capture or self.capture_error is not None or not static.warm or captured >= MAX_GRAPHS:
            static.warm = True
            self.counts["eager"] += 1
            return self._step(static)
        # a capture records kernels without running them: the static rows still hold the step's
        # inputs, and the replay after it runs the step
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    static.logits = self._step(static)
        except (RuntimeError, AssertionError, ValueError) as e:  # later steps of every shape run eagerly
            self.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.log(f"cuda graphs: packed-step capture failed ({self.capture_error}); packed steps run eagerly")
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.counts["eager"] += 1
            return self._step(static)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        static.graph, self.pool = graph, graph.pool()
        self.counts["capture"] += 1
        static.graph.replay()
        return static.logits
