"""The consistent-hash ring: each session key gets an order of preference over the replicas, its
primary first, its secondary next (K3 report §7.4).

Every replica sits on the ring at `vnodes` points; a key's preference list is the distinct replicas met
walking clockwise from the key's point. Taking a replica out moves only its own keys, each to that
key's secondary, and because its points are scattered those secondaries are spread evenly over the
others; putting it back gives it exactly its old keys again.
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable

DEFAULT_VNODES = 256  # points per replica: with 3 replicas, primaries within a few % of even


def ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: Iterable[str], vnodes: int = DEFAULT_VNODES):
        self.names = list(dict.fromkeys(names))
        if not self.names:
            raise ValueError("a hash ring needs at least one replica")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        points = sorted((ring_point(f"{name}#{i}".encode()), name) for name in self.names for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [name for _, name in points]

    def preference(self, key: bytes) -> list[str]:
        """Every replica once, in the key's order of preference: [primary, secondary, ...]."""
        start = bisect.bisect(self._points, ring_point(key))
        order: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            order.setdefault(self._owners[(start + i) % n])
            if len(order) == len(self.names):
                break
        return list(order)
