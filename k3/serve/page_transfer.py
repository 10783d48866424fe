"""The host tier's bytes (host_tier.py): a host page buffer and the copies between it and the device
page pool, first thing in every step (K3 report §7.3).

On CPU the host buffer is plain memory and the copies are two indexed copies, done before the
step reads or writes any page. On CUDA the buffer is pinned and the copies run on a side stream,
one async copy per page (vLLM's swap does the same), ordered so that:
- the side stream waits for the main stream first (the last step's kernels may still write pages);
- write-backs come first, and the main stream waits for them before this step's own work, which
  may overwrite the pages they read;
- prefetches follow on the side stream, overlapping this step; the next step's main stream
  waits for them before anything (the entries they fill become visible to lookups only then);
- the side stream runs in order, so a later write-back into a host page a prefetch reads (once
  the host tier lets it go) comes after that read.
Neither side allocates on the side stream (page views only), so the caching allocator never has to
track a tensor across streams.
"""
from __future__ import annotations

import time

import torch


class PageTransfer:
    def __init__(self, pool: torch.Tensor, num_host_pages: int):
        self.pool = pool
        cuda = pool.device.type == "cuda"
        self.host = torch.empty(num_host_pages, pool.shape[1], dtype=torch.uint8, pin_memory=cuda)
        self.stream = torch.cuda.Stream(pool.device) if cuda else None
        self._prefetched: torch.cuda.Event | None = None  # the last step's prefetches end here
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # prefetches not timed yet
        self.bytes = {"write_back": 0, "prefetch": 0}
        self.prefetch_seconds = 0.0

    def run(self, write_back: list[tuple[int, int]], prefetch: list[tuple[int, int]]) -> None:
        """This step's copies: (device page, host page) write-backs, then (host page, device page)
        prefetches (the order host_tier.HostTier.end_step plans them in)."""
        page = self.pool.shape[1]
        self.bytes["write_back"] += len(write_back) * page
        self.bytes["prefetch"] += len(prefetch) * page
        if self.stream is None:
            if write_back:
                d, h = zip(*write_back)
                self.host[list(h)] = self.pool[list(d)]
            if prefetch:
                t0 = time.perf_counter()
                h, d = zip(*prefetch)
                self.pool[list(d)] = self.host[list(h)]
                self.prefetch_seconds += time.perf_counter() - t0
            return
        main = torch.cuda.current_stream(self.pool.device)
        if self._prefetched is not None:  # this step may read what the last step prefetched
            main.wait_event(self._prefetched)
            self._prefetched = None
        self._harvest_timing()
        if not (write_back or prefetch):
            return
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for d, h in write_back:
                self.host[h].copy_(self.pool[d], non_blocking=True)
            written = self.stream.record_event()
            if prefetch:
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                for h, d in prefetch:
                    self.pool[d].copy_(self.host[h], non_blocking=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                self._timing.append((start, end))
                self._prefetched = end
        main.wait_event(written)

    def _harvest_timing(self) -> None:
        """Add the prefetches that have completed to prefetch_seconds (never waits)."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.prefetch_seconds += start.elapsed_time(end) / 1000
