"""Packing: documents -> one token stream -> fixed-length windows -> packed rows with cu_seqlens.

Each document is tokenized as `bos text eos` and the documents are concatenated into one stream.
Window i covers stream[i*T : i*T + T + 1] (inputs are the first T tokens, targets the last T), so
windows tile the stream and every token but the first is a target exactly once.
Inside a window, a document start opens a new segment: `cu_seqlens` tells the model (KDA state,
MLA attention) that nothing crosses it, and the one target that would cross it (the next
document's bos, predicted from the previous eos) is ignored. A batch of windows is one packed row
[1, n*T] whose segments are the windows' segments, so windows never see each other either.
Tokens are cached on disk per (tokenizer, corpus) fingerprint as .npy files.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from k3.atomic import write_atomic
from k3.data.corpus import DataError

IGNORE_INDEX = -100


@dataclass
class TokenStream:
    tokens: np.ndarray  # [L] uint16 or int32: bos d0 eos bos d1 eos ...
    doc_starts: np.ndarray  # [num_docs] int64 offsets of each document's bos

    def num_windows(self, seq_len: int, *, partial: bool = False) -> int:
        """Full windows only (training) or also a shorter last one (eval covers every target)."""
        targets = len(self.tokens) - 1
        return -(-targets // seq_len) if partial else targets // seq_len


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, N] long
    labels: torch.Tensor  # [1, N] long, IGNORE_INDEX where the target crosses a document start
    cu_seqlens: torch.Tensor  # [S+1] long, segment boundaries inside the row

    def to(self, device) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.labels.to(device), self.cu_seqlens.to(device))


def tokenize_documents(tok: Tokenizer, texts: list[str], bos_id: int, eos_id: int) -> TokenStream:
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    pieces, starts, offset = [], [], 0
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids = np.asarray([bos_id, *enc.ids, eos_id], dtype=dtype)
        starts.append(offset)
        pieces.append(ids)
        offset += len(ids)
    if not pieces:
        raise DataError("no documents to tokenize (an empty train or val split)")
    return TokenStream(np.concatenate(pieces), np.asarray(starts, dtype=np.int64))


def cached_token_stream(cache_dir: Path, tok: Tokenizer, texts: list[str], bos_id: int, eos_id: int) -> TokenStream:
    """tokenize_documents, memoized on disk under a key of the tokenizer and the texts."""
    h = hashlib.sha256(tok.to_str().encode())
    h.update(f"|{bos_id}|{eos_id}|".encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    folder = Path(cache_dir) / h.hexdigest()[:20]
    tok_path, start_path = folder / "tokens.npy", folder / "doc_starts.npy"
    if tok_path.is_file() and start_path.is_file():
        try:  # a damaged entry (a disk filled mid-copy, a stray edit) is rebuilt, never trusted
            tokens, starts = np.load(tok_path, allow_pickle=False), np.load(start_path, allow_pickle=False)
            if tokens.ndim == 1 and starts.ndim == 1 and len(starts) and int(starts[-1]) < len(tokens):
                return TokenStream(tokens, starts)
        except (OSError, ValueError, EOFError):
            pass
    stream = tokenize_documents(tok, texts, bos_id, eos_id)
    folder.mkdir(parents=True, exist_ok=True)
    for path, array in ((tok_path, stream.tokens), (start_path, stream.doc_starts)):
        write_atomic(path, lambda tmp, a=array: np.save(tmp, a))  # per-process temp: ranks may race here
    return stream


def window(stream: TokenStream, index: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(inputs [t], targets [t], segment starts relative to the window) with t <= seq_len."""
    lo = index * seq_len
    hi = min(lo + seq_len, len(stream.tokens) - 1)
    if not 0 <= lo < hi:
        raise IndexError(f"window {index} of length {seq_len} is outside a stream of {len(stream.tokens)} tokens")
    x = stream.tokens[lo:hi].astype(np.int64)
    y = stream.tokens[lo + 1:hi + 1].astype(np.int64)
    # documents starting at stream positions lo+1 .. hi: their bos is a target predicted from the
    # previous document's eos, which crosses a boundary; those starting before hi also open a segment
    a, b = np.searchsorted(stream.doc_starts, [lo + 1, hi + 1], side="left")
    starts = stream.doc_starts[a:b] - lo
    y[starts - 1] = IGNORE_INDEX
    return x, y, [0, *starts[starts < hi - lo].tolist()]


def pack(stream: TokenStream, indices: list[int], seq_len: int) -> PackedBatch:
    """Windows `indices` packed into one row with their segment boundaries."""
    xs, ys, cu = [], [], []
    offset = 0
    for i in indices:
        x, y, starts = window(stream, i, seq_len)
        xs.append(x)
        ys.append(y)
        cu.extend(offset + s for s in starts)
        offset += len(x)
    cu.append(offset)
    return PackedBatch(torch.from_numpy(np.concatenate(xs))[None], torch.from_numpy(np.concatenate(ys))[None],
                       torch.tensor(cu, dtype=torch.long))


@functools.lru_cache(maxsize=4)
def window_order(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled window order of one epoch; a pure function of (seed, epoch), so the data
    position of a run is just the number of windows consumed (no sampler state to save)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=g)


def windows_for_step(num_windows: int, seed: int, step: int, global_batch: int) -> list[int]:
    """The global batch of optimizer step `step` (0-based)."""
    out = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, k = divmod(pos, num_windows)
        out.append(int(window_order(num_windows, seed, epoch)[k]))
    return out
