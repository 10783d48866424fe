"""The prefix cache's block keys (DESIGN §11), torch-free so that `k3 route` can key sessions
with the engine's own hashes without loading torch.

The key of a prefix ending at a hash-block boundary is H(previous key, tokens of the block), from
ROOT_KEY; an endpoint inside a block is keyed H(key of the last full block, tokens since it).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_KEY = b"k3-prefix-cache-root"


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """128-bit BLAKE2b of the parent key and the token ids (collisions would serve wrong text)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], tokens: Sequence[int], hash_block_size: int) -> list[bytes]:
    """Append the keys of the full hash blocks of `tokens` not hashed yet; returns `hashes`."""
    for k in range(len(hashes), len(tokens) // hash_block_size):
        parent = hashes[k - 1] if k else ROOT_KEY
        hashes.append(chain_hash(parent, tokens[k * hash_block_size:(k + 1) * hash_block_size]))
    return hashes
