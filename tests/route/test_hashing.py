"""The hash ring: stable preference lists, even primaries, and a removed replica's keys spread evenly
over the others (K3 report §7.4)."""
from __future__ import annotations

from collections import Counter

import pytest

from k3.route.hashing import HashRing
from k3.route.policy import Policy

URLS = [f"http://127.0.0.1:{8001 + i}" for i in range(3)]
KEYS = [f"session-{i}".encode() for i in range(3000)]


def test_preference_lists_are_every_replica_once_and_stable():
    ring = HashRing(URLS)
    for key in KEYS[:50]:
        order = ring.preference(key)
        assert sorted(order) == sorted(URLS) and order == HashRing(list(reversed(URLS))).preference(key)


def test_primaries_even_and_a_dead_replica_s_keys_split_evenly_over_the_rest():
    ring = HashRing(URLS)
    primaries = Counter(ring.preference(k)[0] for k in KEYS)
    assert all(abs(n - 1000) < 150 for n in primaries.values()), primaries
    # down: each of its keys goes to its secondary; nobody else's key moves
    orphans = [k for k in KEYS if ring.preference(k)[0] == URLS[0]]
    secondaries = Counter(ring.preference(k)[1] for k in orphans)
    even = len(orphans) / 2
    assert all(abs(n - even) / even < 0.2 for n in secondaries.values()), secondaries


def test_policies():
    assert Policy("round_robin", URLS).preference(b"")[0] != Policy("round_robin", URLS).preference(b"")[1:2]
    rr = Policy("round_robin", URLS)
    assert [rr.preference(b"k")[0] for _ in range(3)] == URLS
    assert sorted(Policy("random", URLS, seed=0).preference(b"k")) == sorted(URLS)
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("cache_aware", URLS)
    with pytest.raises(ValueError, match="at least one replica"):
        HashRing([])
