"""The model runner: the only serving code that touches tensors.

Owns the page pool tensor [num_pages, page_bytes] (uint8; the bookkeeping never looks inside)
and, per step: executes the page plan (zero fresh private state, copy hit snapshots and
copy-on-write pages in), runs ONE forward, writes the new state and latent rows back into pages,
snapshots KDA state into checkpoint pages, and samples the requests whose chunk reached their last
known token. Requests that asked for prompt logprobs also get the logits of their chunk's prompt
positions from the same forward, log-softmaxed there alone (`_score`).

Two kinds of forward:
- packed (any step with a prompt chunk): a `K3Cache` built from the requests' private KDA pages
  and MLA page tables, one packed forward with cu_seqlens so requests never share state;
- decode (one token per request): on the decode slots (k3/serve/decode_slots.py), a cache
  allocated once. A step that continues the previous decode step's requests finds their state
  there already (`_slots_continue`); otherwise the rows are refilled from pages (`_fill_slots`). On
  CUDA the step replays the graph captured for its slot shape: an eager decode step is host-bound
  (thousands of small kernel launches), a replay is one launch, and a batch change no longer
  costs the graph.

A decode step writes its new latent rows to pages (a prefix-cache hit may read them as soon as a
block fills) but leaves the KDA states in the slots: a request's whole state per KDA layer, every
step, would be the step's largest copy (K3: 96 heads x 128 x 128 fp32, ~6 MB per layer and
request). The states go to pages (`_flush_states`) before anything reads them there: a step that
does not continue the slots (a refill, a packed step), slots that grow, a KDA checkpoint copy.
Requests freed meanwhile are skipped (`SchedulerOutput.released`): their pages may be someone
else's by then.

Legend: N scheduled requests, T packed new tokens, P tokens per page, M MLA layers, Lk KDA layers,
W = kv_lora_rank + qk_rope_head_dim, H/K/V KDA heads / key dim / value dim, 3C conv channels.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from k3.model.cache import K3Cache, KDAInputs, KDAState, MLAState
from k3.serve.decode_graph import capturable_experts
from k3.serve.decode_slots import DecodeSlots
from k3.serve.packed_graph import PackedGraphs
from k3.serve.page_layout import PageLayout
from k3.serve.page_transfer import PageTransfer
from k3.serve.sampling import SampledToken, Sampler, SamplingParams
from k3.serve.scheduler import ScheduledRequest, SchedulerOutput
from k3.serve.speculative_sampling import verify, with_logprobs
from k3.serve.speculator import Proposal, Speculator

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    # the new tokens of each chunk that reached its last known token: one, or with speculation the
    # kept drafts and the target's next token
    sampled: dict[str, list[SampledToken]]
    scored: dict[str, list[SampledToken]]  # prompt logprobs of each chunk's score_targets


# ModelRunner.step_counts keys: a packed forward (prefill chunks, with or without decode rows); a
# decode step run eagerly, or the step that captured a graph (it runs the step too), or a replay
STEP_KINDS = ("packed", "decode_eager", "decode_graph_capture", "decode_graph_replay", "speculative")


@dataclass
class _RequestMedia:
    spans: tuple  # MediaSpan per image (or video clip)
    pixel_values: torch.Tensor  # every image's patches, packed in order
    grid_thws: torch.Tensor
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> its rows, once encoded

    def rows(self, vision, device, wanted: list[int], counts: Counter) -> dict[int, torch.Tensor]:
        """Rows [length, D] of the `wanted` images, the ones not yet encoded in one packed tower
        call. An image a chunk never covers (a prefix-cache hit) is never encoded."""
        todo = [i for i in wanted if i not in self._rows]
        if todo:
            sizes = self.grid_thws.prod(-1).tolist()
            starts = [0, *itertools.accumulate(sizes)]
            patches = torch.cat([self.pixel_values[starts[i]:starts[i + 1]] for i in todo])
            features = vision.image_features(patches.to(device), self.grid_thws[todo].to(device))
            self._rows.update(zip(todo, features.split([self.spans[i].length for i in todo])))
            counts["images"] += len(todo)
            counts["patches"] += sum(sizes[i] for i in todo)
        return {i: self._rows[i] for i in wanted}


class ModelRunner:
    def __init__(self, model, layout: PageLayout, num_pages: int, *, seed: int | None = None,
                 cuda_graphs: bool = True, speculator: Speculator | None = None, vision=None,
                 sampler: Sampler | None = None, num_host_pages: int = 0, eager_packed: bool = False,
                 packed_graphs: bool = False):
        """`sampler`: the Sampler to pick tokens with (default: a `Sampler(seed)`). `num_host_pages`:
        the prefix cache's host tier (k3/serve/page_transfer.py), 0 for none. `packed_graphs`: with
        `cuda_graphs`, packed steps on static buckets (k3/serve/packed_graph.py). `eager_packed`: run
        packed forwards with compiled regions eagerly (`torch.compiler.set_stance("force_eager")`):
        a packed step's shapes change every step, so compiling them costs more than it saves, while
        a decode step's few shapes compile once and replay fused."""
        self.model = model
        # a K3ForConditionalGeneration around `model`: it encodes the images of requests that have
        # some (add_media), each once, and their rows replace the placeholders' embeddings
        self.vision = vision
        self._media: dict[str, _RequestMedia] = {}
        self.encoder_counts: Counter[str] = Counter()  # images (and clips) encoded, and their patches
        # speculative decoding: every forward verifies drafts and gives the draft its representations
        # (on the decode slots when all requests decode, else packed); counts of drafted / accepted
        # tokens and verified sequences
        self.speculator = speculator
        self.spec_counts: Counter[str] = Counter()
        self.config = model.config
        self._packed_stance = (lambda: torch.compiler.set_stance("force_eager")) if eager_packed else nullcontext
        self.layout = layout
        self.device = next(model.parameters()).device
        if layout.dtype != next(model.parameters()).dtype:
            raise ValueError(f"page layout dtype {layout.dtype} != model dtype {next(model.parameters()).dtype}")
        self.pool = torch.empty(num_pages, layout.page_bytes, dtype=torch.uint8, device=self.device)
        self.transfer = PageTransfer(self.pool, num_host_pages) if num_host_pages > 0 else None
        self.sampler = Sampler(seed) if sampler is None else sampler
        L = layout
        self._state_shape = (L.kda_heads, L.kda_head_dim, L.kda_head_dim)
        self._conv_shape = (L.conv_channels, L.conv_tail)
        # forwards by how they ran (STEP_KINDS), and decode steps that refilled the slots from pages
        # (a batch change): how often batches change and graphs pay off
        self.step_counts: Counter[str] = Counter()
        self.slot_fills = 0
        # the requests whose KDA states in slot rows 0.. are newer than their pages, in row order
        self._states_behind: list[ScheduledRequest] = []
        # graphs need CUDA and routed experts that never read counts on the host (grouped_mm)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and capturable_experts(model)
        self.slots = DecodeSlots(model, self.cuda_graphs)
        # packed steps (prompt chunks) on static buckets, captured on CUDA (k3/serve/packed_graph.py)
        self.packed = PackedGraphs(model, log=log.info) if self.cuda_graphs and packed_graphs else None
        self._kda_layers, self._mla_layers = self.slots.kda_layers, self.slots.mla_layers

    def forget(self, request_id: str) -> None:
        """A request finished: drop its sampling generator, draft state and images."""
        self.sampler.forget(request_id)
        self._media.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget([request_id])

    def add_media(self, request_id: str, spans, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> None:
        """A request's images (k3.serve.request.MediaSpan per image, its packed patches and grids),
        each encoded when a chunk first covers its placeholders (never, when the prefix cache
        holds them all) and kept until the request finishes (a preempted request recomputes its
        prompt without encoding again)."""
        self._media[request_id] = _RequestMedia(tuple(spans), pixel_values, grid_thws)

    def _media_positions(self, requests: list[ScheduledRequest]) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """For each chunk with placeholders: (index in the chunk, the image row to put there)."""
        out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for n, r in enumerate(requests):
            media = self._media.get(r.request_id)
            if media is None:
                continue
            lo, hi = r.num_computed, r.num_computed + len(r.token_ids)
            covered = [i for i, span in enumerate(media.spans) if span.offset < hi and lo < span.offset + span.length]
            if not covered:
                continue
            rows = media.rows(self.vision, self.device, covered, self.encoder_counts)
            for i in covered:
                span = media.spans[i]
                for p in range(max(lo, span.offset), min(hi, span.offset + span.length)):
                    out.setdefault(n, []).append((p - lo, rows[i][p - span.offset]))
        return out

    def _embed(self, ids: torch.Tensor, starts: list[int], media: dict[int, list[tuple[int, torch.Tensor]]]):
        """The packed step's input embeddings, image rows over their placeholders (DESIGN §7)."""
        embeds = self.model.model.embed_tokens(ids)
        for n, rows in media.items():
            index = torch.tensor([starts[n] + i for i, _ in rows], device=self.device)
            embeds[index] = torch.stack([row for _, row in rows]).to(embeds.dtype)
        return embeds

    # ------------------------------------------------------------------ page views
    def latent_pages(self) -> torch.Tensor:
        """The pool as MLA pages: [num_pages, P, M, W] in the model dtype."""
        L = self.layout
        return self.pool.view(L.dtype).view(-1, L.block_size, L.num_mla_layers, L.cache_width)

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

    def read_pages(self, requests: list[ScheduledRequest]) -> tuple[torch.Tensor | None, ...]:
        """The requests' cached KDA states and MLA latents, one gather each for all layers:
        (conv [Lk, N, 3C, W-1], recurrent [Lk, N, H, K, V], latents [N, S, M, W]) (None where the
        model has no such layer); S: the longest request's pages' rows, zeros past each request's
        length."""
        n = len(requests)
        conv = recurrent = latents = None
        if self._kda_layers:
            conv, recurrent = self.read_snapshots(
                [r.state_pages[j] for j in range(len(self._kda_layers)) for r in requests])
            conv, recurrent = conv.view(-1, n, *self._conv_shape), recurrent.view(-1, n, *self._state_shape)
        if self._mla_layers:
            lengths = [r.num_computed for r in requests]
            pages = self.layout.mla_pages_for(max(lengths))
            tables = torch.tensor([(r.page_table + [0] * pages)[:pages] for r in requests], dtype=torch.long,
                                  device=self.device)
            latents = self.latent_pages()[tables].flatten(1, 2)  # [N, pages * P, M, W]
            # Rows past a request's length come from the tail of its last page and from padding
            # pages: bytes no request wrote (a recycled page's KDA state read as bf16 can be NaN or
            # inf). Attention masks them, but a masked row is still multiplied by its zero weight,
            # and 0 * NaN = NaN: they must be finite (MLAState's contract), and are zeroed.
            held = torch.tensor(lengths, device=self.device)[:, None]
            unused = torch.arange(latents.shape[1], device=self.device) >= held
            latents = latents.masked_fill(unused[:, :, None, None], 0)
        return conv, recurrent, latents

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = zip(*pairs)
            self.pool[list(dst)] = self.pool[list(src)]

    # ------------------------------------------------------------------ one step
    def _slots_continue(self, out: SchedulerOutput) -> bool:
        """Whether the decode slots hold exactly this decode step's requests, as it needs them.
        Either way they stop counting as holding anything until this step's forward has run: one
        that raises leaves no half-updated rows to be reused (nor flushed: the engine fails every
        request of the step, and a continuing step's requests are all the slots hold).

        Why reuse is safe: the rows are what `_fill_slots` would read back from the requests' pages
        once `_flush_states` has written the KDA states there (`write_latents` stores every new
        latent row at once), while nothing else writes those pages. Between steps only the plan
        does: `zero` / `copy_before` fill an admission's pages (must be empty); `copy_after` only
        copies out to checkpoint pages; growth appends pages; shared prefix pages are never written
        (copy-on-write). The requests must be the same: ids in the same order, rows in the same
        pages (a request re-added under a finished one's id need not be), and `num_computed` at the
        rows' lengths (the scheduler advances it by exactly the tokens run; a preemption resets it
        and drops the request)."""
        previous, self.slots.holds = self.slots.holds, None
        if previous is None or out.plan.zero or out.plan.copy_before:
            return False
        requests = out.requests
        same_requests = len(requests) == len(previous) and all(
            r.request_id == p.request_id and r.page_table[:len(p.page_table)] == p.page_table
            for r, p in zip(requests, previous))
        return (same_requests and all(len(r.token_ids) == 1 for r in requests)
                and self.slots.host_lengths[:len(requests)].tolist() == [r.num_computed for r in requests])

    def release_held_requests(self) -> None:
        """Forget what the slots hold (the engine is idle: every request they held has finished)."""
        self.slots.holds = None
        self._states_behind = []

    @torch.inference_mode()
    def write_retained(self, retained: set[str]) -> None:
        """Write the KDA states of stopped requests that the prefix cache adopted as checkpoints
        (Scheduler.take_retained) to their pages, where only the decode slots hold them; the other
        rows stay where they are."""
        self._write_slot_rows([(row, r) for row, r in enumerate(self._states_behind) if r.request_id in retained])

    def _flush_states(self, released: set[str]) -> None:
        """Write the KDA states that only the slots hold to pages, for requests not freed since."""
        behind, self._states_behind = self._states_behind, []
        self._write_slot_rows([(row, r) for row, r in enumerate(behind) if r.request_id not in released])

    def _write_slot_rows(self, rows: list[tuple[int, ScheduledRequest]]) -> None:
        """Store the KDA states of these (slot row, request) pairs in the requests' state pages."""
        if rows:
            index = [row for row, _ in rows]
            self.write_states([r for _, r in rows], self.slots.conv[:, index], self.slots.recurrent[:, index])

    def build_cache(self, requests: list[ScheduledRequest]) -> K3Cache:
        """A packed step's cache: the requests' states and latents read from their pages, MLA
        buffers with room for the step's new rows."""
        conv, recurrent, latents = self.read_pages(requests)
        layers: list = [None] * self.config.num_hidden_layers
        for j, i in enumerate(self._kda_layers):
            layers[i] = KDAState(conv[j], recurrent[j])
        lengths = torch.tensor([r.num_computed for r in requests], dtype=torch.long)
        if self._mla_layers:
            n, rows = latents.shape[:2]
            capacity = max(rows, max(r.num_computed + len(r.token_ids) for r in requests))
            on_device = lengths.to(self.device)
            for m, i in enumerate(self._mla_layers):
                buffer = latents.new_zeros(n, capacity, latents.shape[-1])
                buffer[:, :rows] = latents[:, :, m]
                layers[i] = MLAState(buffer, on_device.clone())  # each layer advances its own lengths
        return K3Cache(layers, lengths)

    def write_states(self, requests: list[ScheduledRequest], conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store the requests' KDA states (conv [Lk, N, 3C, W-1], recurrent [Lk, N, H, K, V], rows in
        the requests' order) in their state pages, with a handful of batched copies."""
        if self._kda_layers:
            self.write_snapshots([r.state_pages[j] for j in range(len(self._kda_layers)) for r in requests],
                                 conv.flatten(0, 1), recurrent.flatten(0, 1))

    def write_latents(self, requests: list[ScheduledRequest], cache: K3Cache, kept: list[int] | None = None,
                      rows: list[int] | None = None) -> None:
        """Store the step's new latent rows (from the cache's first rows; padding rows after them are
        dropped) in the requests' MLA pages, with a handful of batched copies. `kept[n]`: how many
        of request n's rows to store (the verified ones, with speculation; default all); `rows[n]`:
        request n's row in the cache (default n)."""
        if not self._mla_layers:
            return
        P = self.layout.block_size
        kept = kept if kept is not None else [len(r.token_ids) for r in requests]
        counts = torch.tensor(kept)
        seq = torch.repeat_interleave(torch.arange(len(requests)), counts)  # [T] request of each new token
        first = torch.tensor([r.num_computed for r in requests])
        offset_in_chunk = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts)[seq]
        position = first[seq] + offset_in_chunk
        # only the pages this step writes (a decode step: one per request), not whole page tables:
        # at long contexts those are thousands of entries per request and step
        low = [r.num_computed // P for r in requests]
        touched = [r.page_table[lo:max(lo, (r.num_computed + k - 1) // P + 1)] for r, lo, k in zip(requests, low, kept)]
        widest = max(1, max(len(t) for t in touched))
        tables = torch.tensor([t + [0] * (widest - len(t)) for t in touched])
        cache_row = seq if rows is None else torch.tensor(rows)[seq]
        local = position // P - torch.tensor(low)[seq]
        cache_row, position, page, row = torch.stack(
            [cache_row, position, tables[seq, local], position % P]).to(self.device).unbind(0)
        values = torch.stack([cache.layers[i].buffer[cache_row, position] for i in self._mla_layers], 1)  # [T, M, W]
        self.latent_pages()[page, row] = values.to(self.layout.dtype)

    def _fill_slots(self, requests: list[ScheduledRequest]) -> None:
        """Load the requests' KDA states and MLA latents from their pages into the decode slots."""
        self.slots.fill([r.num_computed for r in requests], *self.read_pages(requests))
        self.slot_fills += 1

    def _decode(self, ids: torch.Tensor, requests: list[ScheduledRequest],
                continuing: bool) -> tuple[torch.Tensor, K3Cache]:
        """One token per request [N] -> (logits [N, V], the slot cache the step wrote)."""
        shape = self.slots.shape_for(len(requests), max(r.num_computed for r in requests) + 1)
        if continuing and self.slots.must_grow(*shape):
            self._flush_states(released=set())  # the rows are lost with the old storage
            continuing = False
        if not continuing:
            self.slots.reserve(*shape)
            self._fill_slots(requests)
        logits, kind = self.slots.step(ids, shape)
        self.step_counts[f"decode_{kind}"] += 1
        return logits, self.slots.view(*shape)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: dict[str, SamplingParams]) -> StepResult:
        if self.transfer is not None:  # before anything touches a page: write-backs read evicted ones
            self.transfer.run(out.plan.write_back, out.plan.prefetch)
        if self.speculator is not None:
            self.speculator.forget(out.released)
        continuing = self._slots_continue(out)
        if not continuing:
            self._flush_states(out.released)
        if not out.requests:
            return StepResult({}, {})
        plan = out.plan
        if plan.zero:
            self.pool[plan.zero] = 0
        self._copy(plan.copy_before)
        requests = out.requests
        proposals = self._propose(requests, params) if self.speculator is not None else {}
        runs = [r.token_ids + (proposals[r.request_id].tokens if r.request_id in proposals else []) for r in requests]
        ids = torch.tensor([t for run in runs for t in run], dtype=torch.long, device=self.device)
        chosen = [n for n, r in enumerate(requests) if r.sample]  # chunks that reach their last known token
        scoring = [n for n, r in enumerate(requests) if r.score_targets]  # chunks with prompt positions to score
        media = self._media_positions(requests) if self._media else {}
        if self.speculator is not None and all(len(r.token_ids) == 1 and r.sample and not r.score_targets
                                               for r in requests):  # decoding only: on the slots
            return self._speculate_on_slots(requests, runs, proposals, params, plan, continuing)
        if len(requests) == ids.numel() and self.speculator is None and not media:  # [N, 1]: batched decode paths
            logits, cache = self._decode(ids, requests, continuing)
            rows, score_rows = logits[chosen], logits[scoring]
            self._states_behind = requests
            if plan.copy_after:  # a checkpoint copies state pages: they must be current
                self._flush_states(released=set())
            self.write_latents(requests, cache)
            self._copy(plan.copy_after)
            self.slots.holds = requests
            return self._sample(rows, score_rows, requests, chosen, scoring, params)
        self.step_counts["packed"] += 1
        if self.packed is not None and self.speculator is None and not scoring and not media and \
                self.packed.fits([len(run) for run in runs]):
            result = self._packed_graph_step(requests, ids, chosen, params, plan)
            if result is not None:
                return result
        cache = self.build_cache(requests)
        spec = [n for n, r in enumerate(requests) if r.request_id in proposals]
        speculating = set(spec)
        records = self._record_inputs(cache) if spec else []
        starts = [0] + list(itertools.accumulate(len(run) for run in runs))
        # logits at the chosen chunks' last tokens (every verified position of a speculating one),
        # then at the positions to score
        keep, first_row = [], {}
        for n in chosen:
            first_row[n] = len(keep)
            keep += list(range(starts[n], starts[n + 1])) if n in speculating else [starts[n + 1] - 1]
        score_from = len(keep)
        keep += [starts[n] + requests[n].score_from - requests[n].num_computed + k
                 for n in scoring for k in range(len(requests[n].score_targets))]
        cu = torch.tensor(starts, device=self.device)
        extra = {} if self.speculator is None else {"hidden_out": []}  # the draft reads the target's depth
        embeds = self._embed(ids, starts, media) if media else None  # image rows over their placeholders
        tokens = {"input_ids": ids[None]} if embeds is None else {"inputs_embeds": embeds[None]}
        with self._packed_stance():
            kept_logits = self.model(**tokens, cu_seqlens=cu, cache=cache, **extra,
                                     logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device))[0]
        hidden_out = extra.get("hidden_out")
        sampled = {}
        for n in spec:
            r = requests[n]
            verified = kept_logits[first_row[n]:first_row[n] + len(runs[n])]
            sampled[r.request_id] = self._verify(r.request_id, verified, proposals[r.request_id], params[r.request_id])
        computed = [len(r.token_ids) + (len(sampled[r.request_id]) - 1 if n in speculating else 0)
                    for n, r in enumerate(requests)]
        states = [cache.layers[i] for i in self._kda_layers]
        if states:
            if spec:
                self._roll_back(states, records, [requests[n] for n in spec], [starts[n] for n in spec],
                                [computed[n] for n in spec], spec)
            self.write_states(requests, torch.stack([s.conv for s in states]),
                              torch.stack([s.recurrent for s in states]))
        self.write_latents(requests, cache, computed)
        self._copy(plan.copy_after)
        if self.speculator is not None:
            self.speculator.advance([r.request_id for r in requests], [run[:c] for run, c in zip(runs, computed)],
                                    hidden_out, [list(range(s, s + c)) for s, c in zip(starts, computed)],
                                    inputs=embeds)
        plain = [n for n in chosen if n not in speculating]
        result = self._sample(kept_logits[[first_row[n] for n in plain]], kept_logits[score_from:], requests,
                              plain, scoring, params)
        result.sampled.update(sampled)
        return result

    def _packed_graph_step(self, requests: list[ScheduledRequest], ids: torch.Tensor, chosen: list[int],
                           params: dict[str, SamplingParams], plan) -> StepResult | None:
        """A packed step (no drafts, images or prompt scores) through PackedGraphs: the states read
        from pages into its static rows, its forward replayed, the new states and latents written
        back to pages from there. None (and PackedGraphs off for good) when its forward fails."""
        new = [len(r.token_ids) for r in requests]
        starts = [0, *itertools.accumulate(new)]
        conv, recurrent, latents = self.read_pages(requests)
        try:
            logits, cache, rows = self.packed.forward(ids, new, [r.num_computed for r in requests], conv, recurrent,
                                                      latents, [starts[n + 1] - 1 for n in chosen])
        except Exception as e:  # noqa: BLE001 (nothing was written to pages yet: the plain path runs the step)
            log.warning("packed steps on static buckets failed (%s: %s); packed steps run plainly from now on",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.packed = None
            return None
        if self._kda_layers:
            at = torch.tensor(rows, device=self.device)
            self.write_states(requests, torch.stack([cache.layers[i].conv[at] for i in self._kda_layers]),
                              torch.stack([cache.layers[i].recurrent[at] for i in self._kda_layers]))
        self.write_latents(requests, cache, rows=rows)
        self._copy(plan.copy_after)
        return self._sample(logits, logits[:0], requests, chosen, [], params)

    def _sample(self, rows: torch.Tensor, score_rows: torch.Tensor, requests: list[ScheduledRequest],
                chosen: list[int], scoring: list[int], params: dict[str, SamplingParams]) -> StepResult:
        scored = self._score(score_rows, [requests[n] for n in scoring], params) if scoring else {}
        if not chosen:
            return StepResult({}, scored)
        rids = [requests[n].request_id for n in chosen]
        tokens = self.sampler.sample(rows, rids, [params[rid] for rid in rids])
        return StepResult({rid: [t] for rid, t in zip(rids, tokens)}, scored)

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, requests: list[ScheduledRequest], params: dict[str, SamplingParams]) -> dict[str, Proposal]:
        """Draft tokens for the requests the scheduler gave room to speculate (and whose draft
        has a representation to start from)."""
        spec = [r for r in requests if r.num_draft and self.speculator.can_propose(r.request_id)]
        if not spec:
            return {}
        rids = [r.request_id for r in spec]
        ps = [params[rid] for rid in rids]
        proposals = self.speculator.propose(rids, [r.token_ids[-1] for r in spec], [r.num_draft for r in spec], ps,
                                            [None if p.greedy else self.sampler.generator(rid, p)
                                             for rid, p in zip(rids, ps)])
        return dict(zip(rids, proposals))

    def _speculate_on_slots(self, requests: list[ScheduledRequest], runs: list[list[int]],
                            proposals: dict[str, Proposal], params: dict[str, SamplingParams], plan,
                            continuing: bool) -> StepResult:
        """A step of decoding requests only, each with its drafts (or none), on the decode slots:
        the states stay there between steps as for plain decode (no page reads and writes per
        step). The slots' KDA rows before the step are the one checkpoint per sequence; one packed
        forward over every `last token + drafts` run, then each row is replayed from that
        checkpoint over its verified tokens, and its MLA lengths cut back to them."""
        self.step_counts["speculative"] += 1
        N = len(requests)
        rows, columns = self.slots.shape_for(N, max(r.num_computed + len(run) for r, run in zip(requests, runs)))
        if continuing and self.slots.must_grow(rows, columns):
            self._flush_states(released=set())  # the rows are lost with the old storage
            continuing = False
        if not continuing:
            self.slots.reserve(rows, columns)
            self._fill_slots(requests)
        cache = self.slots.view(N, columns)
        kda_states = [cache.layers[i] for i in self._kda_layers]
        before = [KDAState(s.conv.clone(), s.recurrent.clone()) for s in kda_states]  # the checkpoint
        records = self._record_inputs(cache)
        starts = [0] + list(itertools.accumulate(len(run) for run in runs))
        ids = torch.tensor([t for run in runs for t in run], dtype=torch.long, device=self.device)
        hidden_out: list = []
        with self._packed_stance():
            logits = self.model(ids[None], cu_seqlens=torch.tensor(starts, device=self.device), cache=cache,
                                hidden_out=hidden_out)[0]
        sampled = {}
        for n, r in enumerate(requests):
            proposal = proposals.get(r.request_id, Proposal([], None))
            sampled[r.request_id] = self._verify(r.request_id, logits[starts[n]:starts[n + 1]], proposal,
                                                 params[r.request_id])
        computed = [len(sampled[r.request_id]) if sampled[r.request_id][0].error is None else 1 for r in requests]
        for state, replayed in zip(kda_states, self._replay(records, before, starts[:-1], computed)):
            state.conv.copy_(replayed.conv.to(state.conv.dtype))
            state.recurrent.copy_(replayed.recurrent)
        lengths = torch.tensor([r.num_computed + c for r, c in zip(requests, computed)], dtype=torch.long)
        self.slots.host_lengths[:N] = lengths
        if self._mla_layers:
            self.slots.mla_lengths[:, :N] = lengths.to(self.device)
        self._states_behind = requests
        if plan.copy_after:  # a checkpoint copies state pages: they must be current
            self._flush_states(released=set())
        self.write_latents(requests, cache, computed)
        self._copy(plan.copy_after)
        self.slots.holds = requests
        self.speculator.advance([r.request_id for r in requests], [run[:c] for run, c in zip(runs, computed)],
                                hidden_out, [list(range(s, s + c)) for s, c in zip(starts, computed)])
        return StepResult(sampled, {})

    def _verify(self, rid: str, logits: torch.Tensor, proposal: Proposal, p: SamplingParams) -> list[SampledToken]:
        try:
            tokens = verify(logits, proposal.tokens, proposal.probs, p,
                            None if p.greedy else self.sampler.generator(rid, p))
            scale = p.logprob_temperature  # "processed" logprobs: of softmax(z / T)
            out = with_logprobs(tokens, logits if scale == 1.0 else logits.float() / scale, p)
        except Exception as e:  # noqa: BLE001 (as in Sampler.sample: this request fails alone)
            return [SampledToken(-1, error=f"sampling failed: {e}")]
        if proposal.tokens:
            self.spec_counts["verified"] += 1
            self.spec_counts["drafted"] += len(proposal.tokens)
            self.spec_counts["accepted"] += len(tokens) - 1
        return out

    def _record_inputs(self, cache: K3Cache) -> list[KDAInputs]:
        records = []
        for i in self._kda_layers:
            cache.layers[i].record = KDAInputs()
            records.append(cache.layers[i].record)
        return records

    def _roll_back(self, states: list[KDAState], records: list[KDAInputs], spec: list[ScheduledRequest],
                   starts: list[int], computed: list[int], rows: list[int]) -> None:
        """Each speculating request's KDA states become the states after its verified tokens only:
        replayed from its state pages (still the state before this step) over the kept inputs of
        those tokens (DESIGN §11), never a state saved per drafted position."""
        conv, recurrent = self.read_snapshots([r.state_pages[j] for j in range(len(self._kda_layers)) for r in spec])
        conv, recurrent = conv.view(-1, len(spec), *self._conv_shape), recurrent.view(-1, len(spec), *self._state_shape)
        before = [KDAState(conv[j], recurrent[j]) for j in range(len(self._kda_layers))]
        at = torch.tensor(rows, device=self.device)
        for state, replayed in zip(states, self._replay(records, before, starts, computed)):
            state.conv[at] = replayed.conv.to(state.conv.dtype)
            state.recurrent[at] = replayed.recurrent

    def _replay(self, records: list[KDAInputs], before: list[KDAState], starts: list[int],
                computed: list[int]) -> list[KDAState]:
        """Per KDA layer, the states after each sequence's first computed[n] tokens (from position
        starts[n] of the step), advanced from `before` over the recorded inputs of those tokens."""
        index = torch.tensor([s + k for s, c in zip(starts, computed) for k in range(c)], device=self.device)
        cu = torch.tensor([0] + computed, device=self.device).cumsum(0)
        return [self.model.model.layers[i].self_attn.replay(record.take(index), state, cu)
                for i, record, state in zip(self._kda_layers, records, before)]

    def _score(self, rows: torch.Tensor, requests: list[ScheduledRequest],
               params: dict[str, SamplingParams]) -> dict[str, list[SampledToken]]:
        """Prompt logprobs of the requests' score_targets from their rows of logits, in order."""
        targets = [t for r in requests for t in r.score_targets]
        top = [params[r.request_id].prompt_logprobs for r in requests for _ in r.score_targets]
        entries = self.sampler.score(rows, targets, top)
        out, i = {}, 0
        for r in requests:
            out[r.request_id], i = entries[i:i + len(r.score_targets)], i + len(r.score_targets)
        return out
