"""Batch-invariant arithmetic (k3.ops.batch_invariant): inside the mode, an entry of a product, a
softmax row and an element-wise result are bit-identical whatever else is computed beside them,
and so are the logits of k3-tiny for a token whether its sequence is prefilled whole, in random
chunks, token by token, or beside other sequences. Without the mode the same checks fail on this
machine's kernels (the reason it exists); the first tests pin what it relies on."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM
from k3.ops.batch_invariant import batch_invariant, check_device, enabled


@pytest.mark.parametrize("inference", [False, True])
def test_products_do_not_depend_on_the_other_rows_or_columns(inference):
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(inference), batch_invariant():
        for K, N in [(16, 1), (64, 4), (128, 16), (128, 320), (64, 7)]:
            x, w, b = (torch.randn(*s, generator=g) for s in ((40, K), (N, K), (N,)))
            whole, whole_b = F.linear(x, w), F.linear(x, w, b)
            for rows in (slice(0, 1), slice(3, 5), slice(7, 40)):
                assert torch.equal(F.linear(x[rows], w), whole[rows])
                assert torch.equal(F.linear(x[rows], w, b), whole_b[rows])
                assert torch.equal(x[rows] @ w[0], (x @ w[0])[rows])  # mv
            assert torch.equal(F.linear(x, w[:1]), whole[:, :1])  # fewer columns
        a, c = torch.randn(6, 9, 32, generator=g), torch.randn(6, 32, 40, generator=g)
        whole = torch.einsum("bmk,bkn->bmn", a, c)
        assert torch.equal(torch.einsum("bmk,bkn->bmn", a[:2, 4:5], c[:2, :, 3:17]), whole[:2, 4:5, 3:17])
        # a reduction over keys that are masked (zero weights) for this row: the same sum
        p = torch.rand(3, 4, 20, generator=g)
        lat = torch.randn(3, 29, 24, generator=g)
        padded = torch.bmm(torch.cat([p, p.new_zeros(3, 4, 9)], -1), lat)
        assert torch.equal(torch.bmm(p, lat[:, :20]), padded)


def test_softmax_ignores_masked_keys_and_other_rows():
    g = torch.Generator().manual_seed(1)
    with batch_invariant():
        for keys in (1, 5, 15, 17, 40):
            s = torch.randn(6, keys, generator=g)
            ref = torch.softmax(s, -1)
            for masked in (1, 3, 12, 30):
                longer = torch.cat([s, torch.full((6, masked), float("-inf"))], -1)
                assert torch.equal(torch.softmax(longer, -1)[:, :keys], ref)
            assert torch.equal(torch.softmax(s[2:3], -1), ref[2:3])


@pytest.mark.parametrize("op", [torch.sigmoid, F.silu, F.softplus, F.gelu, lambda t: F.gelu(t, approximate="tanh")],
                         ids=["sigmoid", "silu", "softplus", "gelu", "gelu-tanh"])
def test_elementwise_ops_do_not_depend_on_position(op):
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2)) * 4
    with batch_invariant():
        whole = op(x)
        for start, size in [(0, 1), (0, 19), (0, 70), (5, 50), (13, 600)]:
            assert torch.equal(op(x[start:start + size]), whole[start:start + size])
    torch.testing.assert_close(whole.double(), op(x.double()), rtol=2e-5, atol=1e-6)  # the same function


def test_depthwise_conv_is_invariant_and_equals_conv1d():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 24, 30, generator=g), torch.randn(24, 1, 4, generator=g)
    with batch_invariant():
        whole = F.conv1d(x, w, groups=24)
        assert torch.equal(F.conv1d(x[1:2, :, 10:14], w, groups=24), whole[1:2, :, 10:11])  # a decode step's window
    torch.testing.assert_close(whole, F.conv1d(x, w, groups=24), rtol=1e-5, atol=1e-6)


def _logits_by_route(model, seqs, chunks):
    """Every position's logits of every sequence, the sequences packed into each forward,
    `chunks[i]` tokens of sequence i per step (0 once it is done)."""
    cache = K3Cache.empty(model.config, len(seqs))
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for step in range(max(len(c) for c in chunks)):
        lens = [c[step] if step < len(c) else 0 for c in chunks]
        ids = torch.tensor([t for s, d, n in zip(seqs, done, lens) for t in s[d:d + n]])[None]
        logits = model(ids, cu_seqlens=torch.tensor([0] + lens).cumsum(0), cache=cache)[0]
        for i, n in enumerate(lens):
            start = sum(lens[:i])
            out[i] += list(logits[start:start + n])
            done[i] += n
    return [torch.stack(o) for o in out]


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    out = []
    while n:
        out.append(rng.randint(1, min(n, 7)))
        n -= out[-1]
    return out


def test_tiny_model_logits_do_not_depend_on_chunking_or_batch():
    """k3-tiny cut to 4 layers (3 KDA + MLA, the dense FFN and latent MoE, two AttnRes blocks): every
    layer kind, at half the cost of the token-by-token route through 8 layers."""
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320, num_hidden_layers=4, kda_layers=[1, 2, 3],
                                                         full_attn_layers=[4])).eval()
    g, rng = torch.Generator().manual_seed(4), random.Random(4)
    seqs = [torch.randint(6, 320, (n,), generator=g).tolist() for n in (13, 5, 17, 2)]
    with torch.inference_mode(), batch_invariant():
        whole = _logits_by_route(model, seqs, [[len(s)] for s in seqs])
        routes = {"token by token": [[1] * len(s) for s in seqs],
                  "random chunks": [_random_chunks(rng, len(s)) for s in seqs]}
        for name, chunks in routes.items():
            for a, b in zip(whole, _logits_by_route(model, seqs, chunks)):
                assert torch.equal(a, b), name
        for i, s in list(enumerate(seqs))[::2]:  # alone
            assert torch.equal(_logits_by_route(model, [s], [[2] * (len(s) // 2) + [1] * (len(s) % 2)])[0], whole[i])
    assert not enabled()


def test_mode_scope_and_device_check():
    with batch_invariant(False):
        assert not enabled()
    with batch_invariant():
        assert enabled()
    assert not enabled()
    check_device("cpu")
    with pytest.raises(ValueError, match="CPU-only"):
        check_device("cuda")
