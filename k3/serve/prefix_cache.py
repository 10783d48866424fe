"""Prefix cache over the page pool, with hash blocks decoupled from physical pages (DESIGN §11).

Keys are chained hashes: the key of a prefix ending at a hash-block boundary is
H(previous key, tokens of the block); an endpoint inside a block (a prompt end, a chat-turn
boundary) is keyed H(key of the last full block, tokens since it). Entries sit at hash endpoints:
- every full hash block gets an entry holding the MLA pages that intersect its span;
- chosen endpoints (prompt ends, turn boundaries, shared-prefix junctions) also get a KDA
  checkpoint: one snapshot per KDA layer, each on its own pages.
Because an endpoint need not fall on a page boundary, a prompt shorter than one page still hits:
its entry keeps the partly filled page (the rows before the endpoint never change afterwards) and
the KDA checkpoint at its end; a hit copies the partial page (copy-on-write, cache_manager.py).

Lookup: walk the chain from the root while entries exist (the MLA match), then take the longest
endpoint inside it whose KDA checkpoint is complete; a hybrid model cannot resume anywhere else.
Entries hold no references: like vLLM, cached pages sit in the pool's free queue until handed out
again, and that hand-out evicts them here. Losing any page of a KDA checkpoint drops the whole
checkpoint (its sibling snapshots become plain free pages); losing an MLA page drops the entry.
Keys: block_hash.py. With a host tier (host_tier.py) what is dropped is first handed to `on_drop` (written back), and the
same walk runs over both tiers (`walk`).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from k3.serve.block_hash import ROOT_KEY, chain_hash
from k3.serve.block_pool import BlockPool
from k3.serve.page_layout import PageLayout

log = logging.getLogger(__name__)


def walk(tokens: Sequence[int], hashes: list[bytes], limit: int, hash_block_size: int, find, offsets):
    """The lookup's walk, over any tiers: `find(key)` is what they hold at a key (None: nothing),
    `offsets(parent)` the endpoint offsets inside the block after `parent`. Returns (chain: the
    full-block matches from the root, endpoints: every matched endpoint, full or partial) of
    (length, key, found)."""
    H = hash_block_size
    chain, endpoints = [], []
    parent = ROOT_KEY
    for k in range(limit // H + 1):
        for r in sorted(offsets(parent)):
            if k * H + r <= limit:
                key = chain_hash(parent, tokens[k * H:k * H + r])
                found = find(key)
                if found is not None:
                    endpoints.append((k * H + r, key, found))
        if (k + 1) * H > limit:
            break
        found = find(hashes[k])
        if found is None:
            break
        chain.append((k * H + H, hashes[k], found))
        endpoints.append(chain[-1])
        parent = hashes[k]
    return chain, endpoints


@dataclass
class CacheEntry:
    key: bytes
    length: int  # the endpoint: tokens [0, length) are covered
    parent: bytes  # key of the last full hash block before the endpoint (ROOT_KEY for the first)
    mla_pages: dict[int, int]  # page index -> page id, for the pages intersecting the entry's span
    kda_pages: list[list[int]] | None = None  # per KDA layer, the snapshot at `length`


@dataclass
class LookupResult:
    length: int  # reusable tokens (0: a miss)
    page_table: list[int]  # MLA pages covering [0, length)
    kda_pages: list[list[int]] | None  # the checkpoint at `length` (None on a miss)
    mla_match: int  # the longest endpoint whose MLA pages are cached
    reason: str | None  # why it missed or fell short of the MLA match; None for a full hit
    # the hit's pages are being brought back from the host tier: the request waits a step (host_tier.py)
    pending: bool = False
    # the hit is on the host tier and the device pool has no room for it yet: the request waits for
    # room like one the pool cannot admit (cheaper than recomputing what the host holds)
    wait_for_room: bool = False


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    miss_reasons: Counter = field(default_factory=Counter)
    checkpoints_saved: int = 0
    checkpoints_skipped: int = 0  # no free page at the boundary
    checkpoints_invalidated: int = 0  # a sibling snapshot was evicted


class PrefixCache:
    def __init__(self, pool: BlockPool, layout: PageLayout, hash_block_size: int):
        if hash_block_size < 1:
            raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
        self.pool = pool
        self.layout = layout
        self.hash_block_size = hash_block_size
        self.entries: dict[bytes, CacheEntry] = {}
        # parent key -> offsets of endpoints inside the next block, counted: prompts that differ only
        # inside that block end at the same offset under different keys
        self._partials: dict[bytes, Counter[int]] = {}
        self._users: dict[int, set[bytes]] = {}  # page id -> keys of the entries that point to it
        self.stats = CacheStats()
        # called with an entry and whether its MLA pages go too, just before an eviction drops what
        # it points to (the host tier writes it back); None: dropped content is gone
        self.on_drop = None
        # keys whose pages are being copied in from the host tier this step: not looked up before the
        # next step (a request never reads a half-copied page)
        self.loading: set[bytes] = set()
        pool.on_evict = self._evict

    # ------------------------------------------------------------------ keys
    def key_at(self, tokens: Sequence[int], hashes: list[bytes], length: int) -> bytes:
        full, rest = divmod(length, self.hash_block_size)
        if rest == 0:
            return hashes[full - 1]
        parent = hashes[full - 1] if full else ROOT_KEY
        return chain_hash(parent, tokens[full * self.hash_block_size:length])

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: Sequence[int], hashes: list[bytes], limit: int) -> LookupResult:
        """The longest reusable prefix of `tokens` no longer than `limit` (callers keep at least
        one token to compute, so that the last position yields logits)."""
        def find(key):
            return None if key in self.loading else self.entries.get(key)

        chain, endpoints = walk(tokens, hashes, limit, self.hash_block_size, find, self.partial_offsets)
        chain = [e for _, _, e in chain]
        endpoints = [e for _, _, e in endpoints]
        mla_match = max((e.length for e in endpoints), default=0)
        need_kda = self.layout.num_kda_layers > 0
        usable = [e for e in endpoints if e.kda_pages is not None or not need_kda]
        if not usable:
            reason = "no_prefix_match" if not endpoints else "no_kda_checkpoint"
            return LookupResult(0, [], None, mla_match, reason)
        best = max(usable, key=lambda e: e.length)
        pages: dict[int, int] = {}
        for entry in chain:  # deeper entries override: their page holds every row before them too
            if entry.length <= best.length:
                pages.update(entry.mla_pages)
        pages.update(best.mla_pages)
        page_table = [pages[i] for i in range(self.layout.mla_pages_for(best.length))]
        reason = None if best.length == mla_match else "kda_checkpoint_behind_mla_match"
        return LookupResult(best.length, page_table, best.kda_pages, mla_match, reason)

    def partial_offsets(self, parent: bytes):
        """Offsets of the endpoints cached inside the hash block after `parent`."""
        return self._partials.get(parent, ())

    def record(self, result: LookupResult, num_tokens: int, request_id: str = "") -> None:
        """Count one admission's lookup (not every retry of a request waiting for pages)."""
        s = self.stats
        s.queries += 1
        s.query_tokens += num_tokens
        if result.length:
            s.hits += 1
            s.hit_tokens += result.length
        else:
            s.miss_reasons[result.reason] += 1
        if result.reason is not None:
            log.debug("prefix cache %s for %s: %s (reused %d of %d tokens, MLA match %d)",
                      "miss" if not result.length else "short hit", request_id, result.reason,
                      result.length, num_tokens, result.mla_match)

    # ------------------------------------------------------------------ insertion
    def insert(self, tokens: Sequence[int], hashes: list[bytes], length: int, page_table: list[int],
               kda_pages: list[list[int]] | None = None) -> bool:
        """Cache the prefix [0, length) whose MLA rows live in `page_table` (the owner's pages),
        with an optional KDA checkpoint at `length`. Returns True when the checkpoint pages were
        adopted (False: the endpoint already had one, the caller's pages stay uncached)."""
        H = self.hash_block_size
        span_start = (length - 1) // H * H
        parent = hashes[span_start // H - 1] if span_start else ROOT_KEY
        mla = ({i: page_table[i] for i in self.span_pages(length)} if self.layout.num_mla_layers else {})
        return self.insert_entry(self.key_at(tokens, hashes, length), length, parent, mla, kda_pages)

    def span_pages(self, length: int) -> range:
        """Indices of the MLA pages an entry ending at `length` holds (those of its hash block's span)."""
        H, P = self.hash_block_size, self.layout.block_size
        return range((length - 1) // H * H // P, (length - 1) // P + 1)

    def insert_entry(self, key: bytes, length: int, parent: bytes, mla: dict[int, int],
                     kda_pages: list[list[int]] | None = None) -> bool:
        """`insert` by key (the host tier copies entries across tiers): `mla` maps the span's page
        indices to pages; True when the checkpoint pages were adopted."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = CacheEntry(key, length, parent, dict(mla))
            if length % self.hash_block_size:
                self._partials.setdefault(parent, Counter())[length % self.hash_block_size] += 1
            self._use(key, entry.mla_pages.values())
        if kda_pages is None or entry.kda_pages is not None:
            return False
        entry.kda_pages = kda_pages
        self._use(key, (p for snapshot in kda_pages for p in snapshot))
        self.stats.checkpoints_saved += 1
        return True

    def _use(self, key: bytes, pages) -> None:
        for page in pages:
            self._users.setdefault(page, set()).add(key)
            self.pool.mark_cached(page)

    def _unuse(self, key: bytes, pages) -> None:
        for page in pages:
            users = self._users.get(page)
            if users is None:
                continue
            users.discard(key)
            if not users:
                del self._users[page]
                self.pool.uncache(page)

    # ------------------------------------------------------------------ eviction
    def _evict(self, page: int) -> None:
        """The pool is reusing `page`: drop what pointed to it."""
        for key in self._users.pop(page, ()):
            entry = self.entries.get(key)
            if entry is None:
                continue
            snapshot_pages = [p for snap in entry.kda_pages or () for p in snap]
            if self.on_drop is not None:
                self.on_drop(entry, page not in snapshot_pages)
            if entry.kda_pages is not None:
                # one layer's snapshot is gone: the checkpoint cannot be resumed from, so every
                # sibling snapshot is released with it (DESIGN §11)
                entry.kda_pages = None
                self._unuse(key, snapshot_pages)
                self.stats.checkpoints_invalidated += 1
            if page not in snapshot_pages:  # an MLA page: the entry itself is gone
                del self.entries[key]
                self._unuse(key, entry.mla_pages.values())
                if entry.length % self.hash_block_size:
                    offsets, offset = self._partials[entry.parent], entry.length % self.hash_block_size
                    offsets[offset] -= 1
                    if not offsets[offset]:
                        del offsets[offset]
                    if not offsets:
                        del self._partials[entry.parent]
            log.debug("prefix cache evicted page %d: endpoint %d %s", page, entry.length,
                      "checkpoint" if page in snapshot_pages else "entry")
