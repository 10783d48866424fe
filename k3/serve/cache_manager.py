"""Per-request page bookkeeping on top of the pool and the prefix cache (ids only, no tensors).

Each running request owns:
- an MLA page table (shared full pages from a hit plus its own pages; refs held);
- a private KDA state: one snapshot's worth of pages per KDA layer, never shared while it runs; when
  it stops, the prefix cache may adopt these pages as the checkpoint where it stopped (`retain`);
- for the current step only: pinned hit sources waiting to be copied, and checkpoint pages being
  written at a boundary.
Every tensor operation this implies is returned as a plan of page copies / page zeroing that
the runner executes (copies before the forward, checkpoint saves after it).

Admission order matters (DESIGN §11): the hit's pages are pinned BEFORE anything is allocated, so
allocating the request's own pages can never evict the prefix it is about to reuse.

With `host_pages`, evicted cached content is written back to a host tier and found there again
(host_tier.py): `lookup` may then start a prefetch and answer `pending`, and each step's copies
join the plan (`end_step`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from k3.serve.block_hash import extend_block_hashes
from k3.serve.block_pool import BlockPool
from k3.serve.host_tier import HostTier
from k3.serve.page_layout import PageLayout
from k3.serve.prefix_cache import LookupResult, PrefixCache
from k3.serve.request import Request


@dataclass
class PagePlan:
    """Page operations for one step, in execution order."""
    zero: list[int] = field(default_factory=list)  # fresh private state pages (a miss starts from zeros)
    copy_before: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): hit -> private
    copy_after: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): private -> checkpoint
    # host tier (host_tier.py), first of all: (device page, host page) evicted content kept, then
    # (host page, device page) a hit brought back for a later step
    write_back: list[tuple[int, int]] = field(default_factory=list)
    prefetch: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RequestPages:
    page_table: list[int] = field(default_factory=list)
    state: list[list[int]] = field(default_factory=list)  # per KDA layer
    pinned: list[int] = field(default_factory=list)  # hit sources, released after this step's copies
    checkpoint: tuple[int, list[list[int]]] | None = None  # (boundary, pages) written this step
    num_cached_blocks: int = 0  # full hash blocks already inserted into the prefix cache


class CacheManager:
    def __init__(self, layout: PageLayout, num_pages: int, *, hash_block_size: int = 64,
                 enable_prefix_caching: bool = True, retain_stopped: bool = True, host_pages: int = 0):
        self.layout = layout
        self.pool = BlockPool(num_pages)
        self.prefix = PrefixCache(self.pool, layout, hash_block_size)
        self.host = HostTier(self.prefix, host_pages) if host_pages > 0 and enable_prefix_caching else None
        self.enable_prefix_caching = enable_prefix_caching
        self.retain_stopped = retain_stopped  # cache a stopped request's state where it stopped (`retain`)
        self.requests: dict[str, RequestPages] = {}

    @property
    def stats(self):
        return self.prefix.stats

    def max_tokens_per_request(self) -> int:
        """The longest sequence that fits in an otherwise empty pool (private state + one checkpoint)."""
        spare = self.pool.num_pages - 2 * self.layout.pages_per_state
        return spare * self.layout.block_size if self.layout.num_mla_layers else (1 << 62)

    # ------------------------------------------------------------------ admission
    def lookup(self, request: Request) -> LookupResult:
        """The request's prefix hit; with a host tier, a hit that needs host pages starts their
        prefetch and is `pending` (retry at a later step)."""
        tokens = request.hash_token_ids
        limit = len(tokens) - 1  # keep one token to compute: its logits pick the next token
        if not self.enable_prefix_caching:
            return LookupResult(0, [], None, 0, "disabled")
        if request.sampling.prompt_logprobs is not None:  # every prompt position needs its logits (vLLM's rule)
            return LookupResult(0, [], None, 0, "prompt_logprobs")
        if limit < 1:
            return LookupResult(0, [], None, 0, "too_short")
        hashes = extend_block_hashes(request.block_hashes, tokens, self.prefix.hash_block_size)
        if self.host is not None:
            return self.host.lookup(request.request_id, tokens, hashes, limit)
        return self.prefix.lookup(tokens, hashes, limit)

    def begin_step(self) -> None:
        """Before scheduling: the last step's prefetched entries are readable now."""
        if self.host is not None:
            self.host.begin_step()

    def end_step(self, plan: PagePlan) -> None:
        """After scheduling: this step's host-tier copies join its plan."""
        if self.host is not None:
            write_back, prefetch = self.host.end_step()
            plan.write_back += write_back
            plan.prefetch += prefetch

    def pages_to_grow(self, request: Request, num_tokens: int) -> int:
        """Pages a running request still needs to hold `num_tokens` tokens (the admission controller's
        projection)."""
        return max(0, self.layout.mla_pages_for(num_tokens) - len(self.requests[request.request_id].page_table))

    def pages_to_admit(self, hit: LookupResult, num_tokens: int) -> int:
        """Pages `admit` would take for a request that holds `num_tokens` tokens after the hit."""
        return self.layout.pages_per_state + self.layout.mla_pages_for(num_tokens) - hit.length // self.layout.block_size

    def admit(self, request: Request, hit: LookupResult, num_new_tokens: int, plan: PagePlan) -> bool:
        """Give `request` its pages for the hit plus `num_new_tokens`; False (nothing held) when
        the pool cannot. Sets request.num_computed_tokens to the hit length."""
        L, P = self.layout, self.layout.block_size
        shared = hit.length // P  # full pages reused in place
        cow = len(hit.page_table) > shared  # the hit ends inside a page: copy it (it is not ours)
        snapshot_pages = [p for snap in hit.kda_pages or () for p in snap]
        self.pool.pin(hit.page_table + snapshot_pages)  # before any allocation
        need = L.pages_per_state + L.mla_pages_for(hit.length + num_new_tokens) - shared
        if need > self.pool.num_free:
            self.pool.release(list(reversed(hit.page_table + snapshot_pages)))
            return False
        state = [self.pool.allocate(L.pages_per_snapshot) for _ in range(L.num_kda_layers)]
        table = hit.page_table[:shared]
        pinned = snapshot_pages + hit.page_table[shared:]
        if cow:
            table += self.pool.allocate(1)
            plan.copy_before.append((hit.page_table[shared], table[-1]))
        table += self.pool.allocate(L.mla_pages_for(hit.length + num_new_tokens) - len(table))
        if hit.kda_pages is not None:
            plan.copy_before += [(s, d) for src, dst in zip(hit.kda_pages, state) for s, d in zip(src, dst)]
        else:
            plan.zero += [p for snap in state for p in snap]
        self.requests[request.request_id] = RequestPages(
            table, state, pinned, None, hit.length // self.prefix.hash_block_size)
        request.num_computed_tokens = hit.length
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit.length
        if self.enable_prefix_caching:
            self.prefix.record(hit, len(request.all_token_ids), request.request_id)
        if self.host is not None:
            self.host.admitted(request.request_id, hit.length)
        return True

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more MLA rows; False (nothing allocated) when the pool is full."""
        pages = self.requests[request.request_id]
        need = self.layout.mla_pages_for(request.num_computed_tokens + num_new_tokens) - len(pages.page_table)
        if need > self.pool.num_free:
            return False
        pages.page_table += self.pool.allocate(max(need, 0))
        return True

    def checkpoint_positions(self, request: Request, hit: LookupResult, boundaries: tuple[int, ...]) -> list[int]:
        """Where to save KDA checkpoints while computing this request: the prompt end (minus the
        one token a resend recomputes), chat-turn boundaries, and the shared-prefix junction (the
        end of the MLA match when no checkpoint existed there), never every block."""
        if not self.enable_prefix_caching or not self.layout.num_kda_layers:
            return []
        points = set(boundaries) | {request.num_prompt_tokens - 1}
        if hit.mla_match > hit.length:
            points.add(hit.mla_match)
        return sorted(p for p in points if hit.length < p < request.num_tokens)

    def plan_checkpoint(self, request: Request, boundary: int, plan: PagePlan) -> bool:
        """Reserve pages to snapshot the private state at `boundary` after this step's forward."""
        need = self.layout.pages_per_state
        if need > self.pool.num_free:
            self.stats.checkpoints_skipped += 1
            return False
        pages = self.requests[request.request_id]
        snap = [self.pool.allocate(self.layout.pages_per_snapshot) for _ in range(self.layout.num_kda_layers)]
        plan.copy_after += [(s, d) for src, dst in zip(pages.state, snap) for s, d in zip(src, dst)]
        pages.checkpoint = (boundary, snap)
        return True

    # ------------------------------------------------------------------ after a step
    def commit(self, request: Request) -> None:
        """The step ran: cache the newly completed hash blocks and any checkpoint, drop pins."""
        pages = self.requests[request.request_id]
        tokens = request.hash_token_ids
        computed = request.num_computed_tokens
        H = self.prefix.hash_block_size
        if self.enable_prefix_caching:
            extend_block_hashes(request.block_hashes, tokens, H)
            for k in range(pages.num_cached_blocks, computed // H):
                self.prefix.insert(tokens, request.block_hashes, (k + 1) * H, pages.page_table)
            pages.num_cached_blocks = max(pages.num_cached_blocks, computed // H)
        if pages.checkpoint is not None:
            boundary, snap = pages.checkpoint
            if boundary != computed:
                raise RuntimeError(f"checkpoint planned at {boundary}, request computed {computed}")
            self.prefix.insert(tokens, request.block_hashes, boundary, pages.page_table, snap)
            self.pool.release([p for s in snap for p in s])  # adopted: cached at the tail; else head
            pages.checkpoint = None
        self.pool.release(pages.pinned)
        pages.pinned = []

    def retain(self, request: Request) -> bool:
        """Before `free`: cache the request's KDA state where it stopped, at its computed length, as a
        checkpoint made of its own state pages (adopted, not copied), so a later prompt that extends
        its tokens (the next chat turn, a paused rollout resumed) computes only its last one again (SGLang
        caches a finished request's Mamba state the same way). True when adopted: the runner must then
        write the state back to those pages before the next step touches any page. Not when nothing
        sound is there: tokens computed past what the request kept (a stop inside speculated drafts)
        or a checkpoint being written this step."""
        pages = self.requests.get(request.request_id)
        computed = request.num_computed_tokens
        if (pages is None or not self.enable_prefix_caching or not self.retain_stopped or not self.layout.num_kda_layers
                or pages.checkpoint is not None or not 0 < computed < request.num_tokens):
            return False
        # `commit` hashed every full block of the computed tokens already
        return self.prefix.insert(request.hash_token_ids, request.block_hashes, computed, pages.page_table,
                                  pages.state)

    def free(self, request: Request) -> None:
        """Release everything the request holds (finish, abort, preemption)."""
        if self.host is not None:
            self.host.release_hold(request.request_id)
        pages = self.requests.pop(request.request_id, None)
        if pages is None:
            return
        held = pages.pinned + [p for s in pages.state for p in s]
        if pages.checkpoint is not None:
            held += [p for s in pages.checkpoint[1] for p in s]
        self.pool.release(held)
        self.pool.release(list(reversed(pages.page_table)))  # tail pages evicted first

    def holds(self, request_id: str) -> bool:
        return request_id in self.requests

    def page_table(self, request_id: str) -> list[int]:
        return self.requests[request_id].page_table

    def state_pages(self, request_id: str) -> list[list[int]]:
        return self.requests[request_id].state
