"""Packing: windows tile the stream, boundaries are masked, and a packed batch's loss is the sum of
its documents' separate losses (KDA state and MLA attention never cross a document)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.train.packing import IGNORE_INDEX, TokenStream, pack, window, windows_for_step
from tests.helpers import assert_rel_close

BOS, EOS = 0, 1


def make_stream(lengths: list[int], vocab: int = 64, seed: int = 0) -> tuple[TokenStream, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[BOS], rng.integers(6, vocab, n), [EOS]]).astype(np.uint16) for n in lengths]
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    return TokenStream(np.concatenate(docs), starts.astype(np.int64)), docs


def test_windows_tile_the_stream_and_mask_only_boundaries():
    stream, _docs = make_stream([5, 30, 3, 17, 40])
    T = 16
    n = stream.num_windows(T, partial=True)
    targets = []
    for i in range(n):
        x, y, starts = window(stream, i, T)
        assert np.array_equal(x, stream.tokens[i * T:i * T + len(x)])
        for s in starts[1:]:
            assert x[s] == BOS and y[s - 1] == IGNORE_INDEX
        targets.append(y)
    y = np.concatenate(targets)
    assert len(y) == len(stream.tokens) - 1  # every token but the first is a target once
    masked = np.flatnonzero(y == IGNORE_INDEX)
    assert np.array_equal(masked + 1, stream.doc_starts[1:])  # exactly the cross-document targets


def test_pack_rows_and_cu_seqlens():
    stream, _ = make_stream([5, 30, 3, 17, 40])
    b = pack(stream, [2, 0], 16)
    assert b.input_ids.shape == (1, 32) and b.labels.shape == (1, 32)
    cu = b.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 32 and 16 in cu  # windows never share a segment
    assert all(b.input_ids[0, s] == BOS for s in cu[1:-1] if s != 16)


def test_step_batches_are_a_pure_function_of_step():
    a = windows_for_step(10, 3, 4, 3)
    assert a == windows_for_step(10, 3, 4, 3)
    epoch0 = [w for s in range(5) for w in windows_for_step(10, 3, s, 2)]
    assert sorted(epoch0) == list(range(10))  # one epoch visits every window once


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    cfg = load_config("k3-tiny").replace(vocab_size=64, hidden_size=64, num_hidden_layers=4, kda_layers=[],
                                         full_attn_layers=[], kda_chunk_size=16, intermediate_size=96)
    model = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial AttnRes queries, so depth mixing is exercised too
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
    return model


def test_packed_loss_equals_sum_of_separate_document_losses(small_model):
    stream, _docs = make_stream([9, 27, 4, 50, 13, 22])
    T = 40
    n = stream.num_windows(T)
    b = pack(stream, list(range(n)), T)
    with torch.no_grad():
        logits = small_model(b.input_ids, cu_seqlens=b.cu_seqlens)
        packed = F.cross_entropy(logits[0], b.labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
        separate = torch.zeros(())
        cu = b.cu_seqlens.tolist()
        for lo, hi in itertools.pairwise(cu):  # each (piece of a) document alone, fresh state
            seg_logits = small_model(b.input_ids[:, lo:hi])
            separate += F.cross_entropy(seg_logits[0], b.labels[0, lo:hi], ignore_index=IGNORE_INDEX, reduction="sum")
    assert len(cu) - 1 > n  # the batch really holds several documents per window
    assert_rel_close("packed loss", separate, packed, 1e-5)


def test_packing_matters(small_model):
    """Control: the same tokens without cu_seqlens (state crossing documents) give another loss."""
    stream, _ = make_stream([9, 27, 4, 50, 13, 22])
    b = pack(stream, [0], 40)
    with torch.no_grad():
        packed = small_model(b.input_ids, cu_seqlens=b.cu_seqlens)
        crossing = small_model(b.input_ids)
    assert (packed - crossing).abs().max() > 1e-3
