"""Which replicas a request tries, in order: `affinity` (the session key's preference list on the
hash ring: primary, secondary, ...), or the baselines `round_robin` and `random` (no affinity)."""
from __future__ import annotations

import itertools
import random

from k3.route.hashing import DEFAULT_VNODES, HashRing

POLICIES = ("affinity", "round_robin", "random")


class Policy:
    def __init__(self, name: str, urls: list[str], vnodes: int = DEFAULT_VNODES, seed: int | None = None):
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        self.name, self.urls = name, list(urls)
        self.ring = HashRing(self.urls, vnodes)
        self._turn = itertools.count()
        self._random = random.Random(seed)

    def preference(self, key: bytes) -> list[str]:
        """Every replica once, the one to try first first (the caller skips those that are down)."""
        if self.name == "affinity":
            return self.ring.preference(key)
        if self.name == "round_robin":
            start = next(self._turn) % len(self.urls)
            return self.urls[start:] + self.urls[:start]
        return self._random.sample(self.urls, len(self.urls))
