"""The model runner: the only serving code that touches tensors.

Owns the page pool tensor [num_pages, page_bytes] (uint8; the bookkeeping never looks inside)
and, per step: executes the page plan (zero fresh private state, copy hit snapshots and
copy-on-write pages in), builds a `K3Cache` for the scheduled requests from their private KDA
pages and MLA page tables (a decode step that continues the previous step's requests keeps the
cache that step left instead: `_take_resident_cache`), runs ONE forward (packed with cu_seqlens
so requests never share state; a step of one token per request runs as a uniform [N, 1] batch,
the model's batched decode path), writes the new state and latent rows back into pages, snapshots
KDA state into checkpoint pages, and samples the requests whose chunk reached their last known token.

On CUDA, a decode batch that stays the same for a few steps is captured as a CUDA graph over its
resident cache (`CUDAGraphDecoder`) and later steps replay it: an eager decode step is host-bound
(thousands of small kernel launches), a replay is one launch. The graph lives as long as the
resident cache; a new batch composition captures anew.

Legend: N scheduled requests, T packed new tokens, P tokens per page, M MLA layers,
W = kv_lora_rank + qk_rope_head_dim, H/K/V KDA heads / key dim / value dim, 3C conv channels.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from k3.model.cache import MLA_CAPACITY_STEP, K3Cache, KDAState, MLAState
from k3.model.decode_graph import CUDAGraphDecoder, capturable_experts
from k3.serve.page_layout import PageLayout
from k3.serve.sampling import SampledToken, Sampler, SamplingParams
from k3.serve.scheduler import ScheduledRequest, SchedulerOutput


# A capture costs about two eager steps, so it waits until the same batch has reused its cache
# this many times (a batch that changes every step never captures), and needs room for this many
# more tokens in the cache's MLA buffers (they cannot grow under a live graph).
CAPTURE_AFTER_REUSES = 2
GRAPH_MIN_ROOM = 16
# ModelRunner.step_counts keys: a packed forward (prefill chunks, with or without decode rows); a
# decode step over a cache built from pages (a new batch), or eager over the kept cache, or the
# step that captured a graph (it runs the step too), or a replay
STEP_KINDS = ("packed", "decode_eager_built", "decode_eager_reused", "decode_graph_capture", "decode_graph_replay")


@dataclass
class ResidentCache:
    """The last executed step's requests, the cache its forward left (equal to their pages), how
    many steps in a row reused it, and its decode graph once captured."""
    requests: list[ScheduledRequest]
    cache: K3Cache
    reuses: int = 0
    graph: CUDAGraphDecoder | None = None


class ModelRunner:
    def __init__(self, model, layout: PageLayout, num_pages: int, *, seed: int | None = None,
                 cuda_graphs: bool = True):
        self.model = model
        self.config = model.config
        self.layout = layout
        self.device = next(model.parameters()).device
        if layout.dtype != next(model.parameters()).dtype:
            raise ValueError(f"page layout dtype {layout.dtype} != model dtype {next(model.parameters()).dtype}")
        self.pool = torch.empty(num_pages, layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.sampler = Sampler(seed)
        L = layout
        self._kda_layers = [i for i in range(self.config.num_hidden_layers) if not self.config.is_mla_layer(i)]
        self._mla_layers = [i for i in range(self.config.num_hidden_layers) if self.config.is_mla_layer(i)]
        self._state_shape = (L.kda_heads, L.kda_head_dim, L.kda_head_dim)
        self._conv_shape = (L.conv_channels, L.conv_tail)
        self._resident: ResidentCache | None = None
        # forwards by how they ran (STEP_KINDS): how often batches change and graphs pay off
        self.step_counts: Counter[str] = Counter()
        # graphs need CUDA and routed experts that never read counts on the host (grouped_mm)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and capturable_experts(model)

    # ------------------------------------------------------------------ page views
    def _latent_pages(self) -> torch.Tensor:
        """The pool as MLA pages: [num_pages, P, M, W] in the model dtype."""
        L = self.layout
        return self.pool.view(L.dtype).view(-1, L.block_size, L.num_mla_layers, L.latent_dim)

    def read_snapshots(self, pages: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One KDA layer's state for N requests from their pages -> (conv [N,3C,W-1], recurrent [N,H,K,V])."""
        L = self.layout
        raw = self.pool[[p for ps in pages for p in ps]].view(len(pages), -1)[:, :L.snapshot_bytes]
        recurrent = raw[:, :L.recurrent_bytes].contiguous().view(torch.float32).view(-1, *self._state_shape)
        conv = raw[:, L.recurrent_bytes:].contiguous().view(L.dtype).view(-1, *self._conv_shape)
        return conv, recurrent

    def write_snapshots(self, pages: list[list[int]], conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        L = self.layout
        n = len(pages)
        raw = torch.cat([recurrent.float().contiguous().view(n, -1).view(torch.uint8),
                         conv.to(L.dtype).contiguous().view(n, -1).view(torch.uint8)], dim=1)
        padded = raw.new_zeros(n, L.pages_per_snapshot * L.page_bytes)
        padded[:, :L.snapshot_bytes] = raw
        self.pool[[p for ps in pages for p in ps]] = padded.view(-1, L.page_bytes)

    def read_latents(self, page_table: list[int], num_tokens: int) -> torch.Tensor:
        """[num_tokens, M, W]: the cached latent rows of one request."""
        if num_tokens == 0:
            return self._latent_pages().new_zeros(0, self.layout.num_mla_layers, self.layout.latent_dim)
        n_pages = self.layout.mla_pages_for(num_tokens)
        return self._latent_pages()[page_table[:n_pages]].flatten(0, 1)[:num_tokens]

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.pool[list(dst)] = self.pool[list(src)]

    # ------------------------------------------------------------------ one step
    def _take_resident_cache(self, out: SchedulerOutput) -> ResidentCache | None:
        """The previous step's cache if this decode step reads exactly what it holds, else None.
        Either way the runner stops holding it: an unused cache is freed before a new one is built,
        and a forward that raises leaves no half-updated cache behind.

        Why reuse is safe: `write_back` stored the cache's KDA states and new latent rows into the
        requests' pages (same dtypes), so the cache is what `build_cache` would read back while
        nothing else writes those pages. Between steps only the plan does: `zero` / `copy_before`
        fill an admission's pages (must be empty); `copy_after` only copies out to checkpoint pages;
        growth appends pages; shared prefix pages are never written (copy-on-write). The requests
        must be the same: ids in the same order, rows in the same pages (a request re-added under a
        finished one's id need not be), and `num_computed` at the cache's length (the scheduler
        advances it by exactly the tokens run; a preemption resets it and drops the request)."""
        resident, self._resident = self._resident, None
        if resident is None or out.plan.zero or out.plan.copy_before:
            return None
        previous, cache = resident.requests, resident.cache
        requests = out.requests
        decode_only = all(len(r.token_ids) == 1 for r in requests)
        same_requests = len(requests) == len(previous) and all(
            r.request_id == p.request_id and r.page_table[:len(p.page_table)] == p.page_table
            for r, p in zip(requests, previous))
        continues = cache.lengths.tolist() == [r.num_computed for r in requests]
        return resident if decode_only and same_requests and continues else None

    def release_resident_cache(self) -> None:
        self._resident = None

    def build_cache(self, requests: list[ScheduledRequest]) -> K3Cache:
        layers: list = [None] * self.config.num_hidden_layers
        for j, i in enumerate(self._kda_layers):
            conv, recurrent = self.read_snapshots([r.state_pages[j] for r in requests])
            layers[i] = KDAState(conv, recurrent)
        if self._mla_layers:
            per_request = [self.read_latents(r.page_table, r.num_computed) for r in requests]
            needed = max(r.num_computed + len(r.token_ids) for r in requests)
            # room for the decode steps that follow (a graph is captured only with room to spare)
            capacity = (needed // MLA_CAPACITY_STEP + 1) * MLA_CAPACITY_STEP
            for m, i in enumerate(self._mla_layers):
                layers[i] = MLAState.from_rows([lat[:, m] for lat in per_request], capacity)
        lengths = torch.tensor([r.num_computed for r in requests], dtype=torch.long)
        return K3Cache(layers, lengths)

    def write_back(self, requests: list[ScheduledRequest], cache: K3Cache) -> None:
        """Store the step's new KDA states and latent rows in the requests' pages, with a handful of
        batched copies whatever the number of requests and layers (every step pays for this)."""
        if self._kda_layers:
            states = [cache.layers[i] for i in self._kda_layers]
            self.write_snapshots([r.state_pages[j] for j in range(len(states)) for r in requests],
                                 torch.cat([s.conv for s in states]), torch.cat([s.recurrent for s in states]))
        if not self._mla_layers:
            return
        counts = torch.tensor([len(r.token_ids) for r in requests])
        seq = torch.repeat_interleave(torch.arange(len(requests)), counts)  # [T] request of each new token
        first = torch.tensor([r.num_computed for r in requests])
        offset_in_chunk = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[seq]
        position = first[seq] + offset_in_chunk
        widest = max(len(r.page_table) for r in requests)
        tables = torch.tensor([r.page_table + [0] * (widest - len(r.page_table)) for r in requests])
        P = self.layout.block_size
        seq, position, page, row = torch.stack(
            [seq, position, tables[seq, position // P], position % P]).to(self.device).unbind(0)
        values = torch.stack([cache.layers[i].buffer[seq, position] for i in self._mla_layers], 1)  # [T, M, W]
        self._latent_pages()[page, row] = values.to(self.layout.dtype)

    def _decode(self, ids: torch.Tensor, resident: ResidentCache) -> torch.Tensor:
        """One token per request [N] -> logits [N, V]: replayed from the resident cache's graph
        (captured once the batch has lasted, with room in its MLA buffers), else an eager forward."""
        cache = resident.cache
        room = min((s.capacity for s in cache.layers if isinstance(s, MLAState)), default=None)
        room = None if room is None else room - int(cache.lengths.max())
        captured = False
        if room is not None and room < 1:
            resident.graph = None  # the eager forward reallocates the buffers the graph holds
        elif (resident.graph is None and self.cuda_graphs and resident.reuses >= CAPTURE_AFTER_REUSES
              and (room is None or room >= GRAPH_MIN_ROOM)):
            resident.graph = CUDAGraphDecoder(self.model, cache, warmup_steps=1)
            captured = True
        if resident.graph is not None:
            self.step_counts["decode_graph_capture" if captured else "decode_graph_replay"] += 1
            return resident.graph.step(ids)
        self.step_counts["decode_eager_built" if resident.reuses == 0 else "decode_eager_reused"] += 1
        return self.model(ids.view(-1, 1), cache=cache)[:, 0]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: dict[str, SamplingParams]) -> dict[str, SampledToken]:
        resident = self._take_resident_cache(out)
        if not out.requests:
            return {}
        plan = out.plan
        if plan.zero:
            self.pool[plan.zero] = 0
        self._copy(plan.copy_before)
        requests = out.requests
        if resident is None:
            resident = ResidentCache(requests, self.build_cache(requests))
        else:
            resident.reuses += 1
        cache = resident.cache
        ids = torch.tensor([t for r in requests for t in r.token_ids], dtype=torch.long, device=self.device)
        cu = torch.tensor([0] + [len(r.token_ids) for r in requests], device=self.device).cumsum(0)
        chosen = [n for n, r in enumerate(requests) if r.sample]  # chunks that reach their last known token
        if len(requests) == ids.numel():  # decode only: a uniform [N, 1] batch takes the batched paths
            rows = self._decode(ids, resident)[chosen]
        else:  # logits only at the chosen chunks' last tokens
            self.step_counts["packed"] += 1
            rows = self.model(ids[None], cu_seqlens=cu, cache=cache, logits_to_keep=cu[1:][chosen] - 1)[0]
        self.write_back(requests, cache)
        self._copy(plan.copy_after)
        resident.requests = requests
        self._resident = resident
        if not chosen:
            return {}
        rids = [requests[n].request_id for n in chosen]
        return dict(zip(rids, self.sampler.sample(rows, rids, [params[rid] for rid in rids])))
