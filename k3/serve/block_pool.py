"""One pool of equal-size pages: reference counts and a single free queue in eviction order.

Pure bookkeeping over page ids (the bytes live in the runner's pool tensor, DESIGN §11). Follows
vLLM v1's BlockPool: a page whose count drops to zero goes back to the free queue but keeps its
cached content until the queue hands it out again; that hand-out is the eviction. So there is one
free list and LRU eviction falls out of the queue order:
- a page released with cached content goes to the TAIL (most recently used, evicted last);
- a page released without content (private state, a superseded copy) goes to the HEAD, so plain
  free pages are always reused before any cached page is evicted;
- pinning a page (count 0 -> 1) takes it out of the queue, so it cannot be evicted while in use.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class NoFreePagesError(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for (nothing is allocated)."""


class BlockPool:
    def __init__(self, num_pages: int, on_evict: Callable[[int], None] | None = None):
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.ref_cnt = [0] * num_pages
        # page id -> None, head = next to hand out; cached pages stay here while unreferenced
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._cached: set[int] = set()
        self.on_evict = on_evict  # called with a cached page id just before its content is reused
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages that `allocate` can hand out now (free, whether or not they hold cached content)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def usage(self) -> float:
        """Fraction of pages referenced by a running request (cached-but-free pages count as free)."""
        return self.num_used / self.num_pages

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def free_order(self) -> list[int]:
        """The free queue, next page to hand out first (for tests and debugging)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """n pages with count 1, taken from the head of the free queue (evicting cached ones)."""
        if n > len(self._free):
            raise NoFreePagesError(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            if page in self._cached:
                self._cached.discard(page)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(page)
            self.ref_cnt[page] = 1
            pages.append(page)
        return pages

    def pin(self, pages: list[int]) -> None:
        """Take a reference on each page (a cache hit): a free page leaves the free queue."""
        for page in pages:
            if self.ref_cnt[page] == 0:
                del self._free[page]
            self.ref_cnt[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop a reference on each page, in the given order; callers release a sequence's pages
        tail first so that its least shareable pages are evicted first."""
        for page in pages:
            if self.ref_cnt[page] <= 0:
                raise RuntimeError(f"page {page} released more often than referenced")
            self.ref_cnt[page] -= 1
            if self.ref_cnt[page] == 0:
                self._free[page] = None
                if page not in self._cached:
                    self._free.move_to_end(page, last=False)

    def mark_cached(self, page: int) -> None:
        """The page now holds content a prefix-cache entry points to."""
        self._cached.add(page)

    def uncache(self, page: int) -> None:
        """No entry points to the page any more; if it is free it moves to the head (reuse first)."""
        self._cached.discard(page)
        if page in self._free:
            self._free.move_to_end(page, last=False)
