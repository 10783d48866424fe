"""The prefix cache's host-memory tier: a second, larger pool that catches what the device pool
evicts and hands it back on a later hit (K3 report §7.3; DESIGN §11). Bookkeeping only: the
bytes move in the runner (k3/serve/page_transfer.py), as the plan's `write_back` and `prefetch`.

- Write-back: when the device pool reuses a cached page, every entry pointing to it is copied to
  host pages first (its MLA pages, and its KDA checkpoint with them), unless the host tier already
  holds that much. Only cached content moves; a running request's private state never does.
- The host pages are a `PrefixCache` of their own over a `BlockPool` where every page is free and
  cached: LRU falls out of the free queue, and losing a page drops what used it, as on the device.
- Lookup: the device lookup's rule over both tiers at once (`prefix_cache.walk`): the longest MLA
  match whose KDA checkpoint exists at the same boundary, each entry in whichever tier holds it.
  When part of that hit is only on the host, its pages are prefetched: device pages are
  allocated (the hit's device pages pinned first), the copies planned, and the entries put back
  into the device cache marked loading; the request waits one step (the copy overlaps that step on
  CUDA) and then hits on the device like any other. A loading entry is never looked up, so no
  request reads a half-copied page. If the device pool cannot take the pages now, the request
  takes the device-only hit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3.serve.block_pool import BlockPool
from k3.serve.prefix_cache import CacheEntry, LookupResult, PrefixCache, walk


@dataclass
class HostTierStats:
    prefetches: int = 0  # hits that started a prefetch
    hits: int = 0  # admissions whose hit was extended from the host tier
    hit_tokens: int = 0  # tokens those hits gained over the device-only hit
    write_back_pages: int = 0
    prefetch_pages: int = 0
    write_backs_skipped: int = 0  # the host tier held it already (touched, not copied)
    write_backs_dropped: int = 0  # larger than the whole host tier


class HostTier:
    def __init__(self, device: PrefixCache, num_pages: int):
        self.device = device
        self.layout = device.layout
        self.pool = BlockPool(num_pages)
        self.cache = PrefixCache(self.pool, device.layout, device.hash_block_size)
        self.stats = HostTierStats()
        self._write_back: list[tuple[int, int]] = []  # (device page, host page), this step
        self._prefetch: list[tuple[int, int]] = []  # (host page, device page), this step
        self._reading: list[int] = []  # host pages read by the last step's prefetches: not reused before issued
        self._holds: dict[str, list[int]] = {}  # request -> device pages pinned for it until it is admitted
        self._old_holds: dict[str, list[int]] = {}
        self._gains: dict[str, int] = {}  # request -> tokens its prefetch added to its device-only hit
        device.on_drop = self.write_back

    # ------------------------------------------------------------------ write-back
    def write_back(self, entry: CacheEntry, mla_lost: bool) -> None:
        """The device is dropping `entry` (or only its checkpoint): keep a host copy of it."""
        held = self.cache.entries.get(entry.key)
        need_mla = held is None
        need_kda = entry.kda_pages is not None and (held is None or held.kda_pages is None)
        kept = [] if held is None else list(held.mla_pages.values()) + [p for s in held.kda_pages or () for p in s]
        self.pool.pin(kept)  # a touch (most recently used), and kept out of this write-back's allocation
        try:
            if not (need_mla or need_kda):
                self.stats.write_backs_skipped += 1
                return
            n = (len(entry.mla_pages) if need_mla else 0) + (self.layout.pages_per_state if need_kda else 0)
            if n > self.pool.num_free:
                self.stats.write_backs_dropped += 1
                return
            mla = held.mla_pages if held is not None else dict(zip(entry.mla_pages, self._copy_out(
                list(entry.mla_pages.values()))))
            kda = [self._copy_out(s) for s in entry.kda_pages] if need_kda else None
            self.cache.insert_entry(entry.key, entry.length, entry.parent, mla, kda)
            new = ([] if held is not None else list(mla.values())) + [p for s in kda or () for p in s]
            self.pool.release(new)  # cached now: at the tail of the host LRU
        finally:
            self.pool.release(kept)

    def _copy_out(self, device_pages: list[int]) -> list[int]:
        host = self.pool.allocate(len(device_pages))
        self._write_back += zip(device_pages, host)
        self.stats.write_back_pages += len(host)
        return host

    # ------------------------------------------------------------------ lookup
    def lookup(self, request_id: str, tokens: Sequence[int], hashes: list[bytes], limit: int) -> LookupResult:
        """The device lookup's rule over both tiers; a hit that needs host pages starts their
        prefetch and comes back `pending` (the request is admitted at a later step). Only when the
        device pool also has room to admit the request after it: a prefetch that would be evicted
        again before its request runs is only churn. Without that room the request waits for it
        (`wait_for_room`) while other requests hold pages, else takes the device-only hit."""
        dev, host = self.device, self.cache

        def find(key):
            d, h = dev.entries.get(key), host.entries.get(key)
            return None if d is None and h is None else (d, h)

        def offsets(parent):
            return set(dev.partial_offsets(parent)) | set(host.partial_offsets(parent))

        chain, endpoints = walk(tokens, hashes, limit, dev.hash_block_size, find, offsets)
        need_kda = self.layout.num_kda_layers > 0

        def checkpoint(found):  # (entry whose checkpoint it is, on the device?) or None
            d, h = found
            if d is not None and d.kda_pages is not None:
                return d, True
            return (h, False) if h is not None and h.kda_pages is not None else None

        mla_match = max((length for length, _, _ in endpoints), default=0)
        usable = [m for m in endpoints if checkpoint(m[2]) is not None or not need_kda]
        if not usable:
            return dev.lookup(tokens, hashes, limit)  # the same miss, with its reason
        best_length, best_key, best = max(usable, key=lambda m: m[0])
        # page index -> (on the device?, page, key): deeper entries override, as on the device
        pages: dict[int, tuple[bool, int, bytes]] = {}
        for length, key, (d, h) in chain + [(best_length, best_key, best)]:
            if length <= best_length:
                src = d if d is not None else h
                pages.update({i: (d is not None, p, key) for i, p in src.mla_pages.items()})
        pages = {i: pages[i] for i in range(self.layout.mla_pages_for(best_length))}
        snap = checkpoint(best) if need_kda else None
        loading = {key for _, _, key in pages.values()} | ({best_key} if snap else set())
        if loading & dev.loading:  # another request's prefetch brings it in: ready next step
            return LookupResult(0, [], None, mla_match, "host_prefetch", pending=True)
        if all(on_dev for on_dev, _, _ in pages.values()) and (snap is None or snap[1]):
            table = [p for _, p, _ in pages.values()]
            reason = None if best_length == mla_match else "kda_checkpoint_behind_mla_match"
            return LookupResult(best_length, table, snap[0].kda_pages if snap else None, mla_match, reason)
        return self._prefetch_hit(request_id, tokens, hashes, limit, chain, best_length, best_key, best, pages, snap,
                                  mla_match, len(tokens))

    def _prefetch_hit(self, request_id, tokens, hashes, limit, chain, best_length, best_key, best, pages, snap,
                      mla_match, num_tokens) -> LookupResult:
        dev = self.device
        from_host = {i: p for i, (on_dev, p, _) in pages.items() if not on_dev}
        host_kda = snap[0].kda_pages if snap is not None and not snap[1] else None
        reading = list(from_host.values()) + [p for s in host_kda or () for p in s]
        pinned = [p for on_dev, p, _ in pages.values() if on_dev]
        pinned += [p for s in (snap[0].kda_pages if snap is not None and snap[1] else ()) for p in s]
        fallback = dev.lookup(tokens, hashes, limit)
        busy = dev.pool.num_used > 0  # pages will come back as running requests finish
        # pin first, in both tiers: the device allocation below evicts, and its write-backs allocate
        # host pages; neither may take a page this hit reads
        dev.pool.pin(pinned)
        self.pool.pin(reading)
        L = self.layout
        admit = L.pages_per_state + L.mla_pages_for(num_tokens) - L.mla_pages_for(best_length) + 1
        if len(from_host) + (L.pages_per_state if host_kda else 0) + admit > dev.pool.num_free:
            dev.pool.release(list(reversed(pinned)))
            self.pool.release(reading)
            if busy:
                return LookupResult(0, [], None, mla_match, "host_wait", wait_for_room=True)
            return fallback
        new = dev.pool.allocate(len(from_host))
        table = {i: p for i, (on_dev, p, _) in pages.items() if on_dev} | dict(zip(from_host, new))
        self._prefetch += zip(from_host.values(), new)
        kda = None
        if host_kda is not None:
            kda = [dev.pool.allocate(len(s)) for s in host_kda]
            self._prefetch += [(h, d) for hs, ds in zip(host_kda, kda) for h, d in zip(hs, ds)]
        self._reading += reading  # released once the copies are issued (the next step)
        self.stats.prefetch_pages += len(reading)
        # the device cache gets back every entry of the hit it lacks (an entry evicted by the
        # allocation above too: its pages are all in `table`), loading until the next step
        matches = {key: (length, found) for length, key, found in chain if length <= best_length}
        matches[best_key] = (best_length, best)
        for key, (length, (d, h)) in matches.items():
            src, current = d if d is not None else h, dev.entries.get(key)
            if current is None or (key == best_key and kda is not None):
                dev.insert_entry(key, length, src.parent, {i: table[i] for i in src.mla_pages},
                                 kda if key == best_key else None)
                dev.loading.add(key)
        self._holds[request_id] = pinned + new + [p for s in kda or () for p in s]
        self.stats.prefetches += 1
        self._gains[request_id] = best_length - fallback.length
        return LookupResult(0, [], None, mla_match, "host_prefetch", pending=True)

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """The last step's copies were issued: its loading entries may be read (on CUDA the step
        waits for them first), and the host pages they were read from may be reused."""
        self.device.loading.clear()
        self.pool.release(self._reading)
        self._reading = []

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's copies (write-backs, then prefetches); holds older than this step are
        released (their requests were admitted, or take their chance with the others)."""
        for pages in self._old_holds.values():
            self.device.pool.release(list(reversed(pages)))
        self._old_holds, self._holds = self._holds, {}
        last = {h: d for d, h in self._write_back}  # a host page written twice this step keeps the later copy
        write_back = [(d, h) for h, d in last.items()]
        prefetch, self._write_back, self._prefetch = self._prefetch, [], []
        return write_back, prefetch

    def admitted(self, request_id: str, hit_length: int) -> None:
        """Count a prefetched hit once its request runs on it."""
        gain = self._gains.pop(request_id, 0)
        if gain and hit_length:
            self.stats.hits += 1
            self.stats.hit_tokens += min(gain, hit_length)

    def release_hold(self, request_id: str) -> None:
        """A request that held prefetched pages has finished (aborted while waiting)."""
        self._gains.pop(request_id, None)
        for holds in (self._holds, self._old_holds):
            pages = holds.pop(request_id, None)
            if pages is not None:
                self.device.pool.release(list(reversed(pages)))
