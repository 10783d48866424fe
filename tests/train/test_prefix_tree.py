"""The prefix-tree forward (k3/train/prefix_tree.py): segments whose beginnings branch at several
depths give the whole packed forward's logits and gradients, bit for bit in batch-invariant mode."""
from __future__ import annotations

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.ops.batch_invariant import batch_invariant
from k3.train.prefix_tree import _tree, tail_logits
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)


def _row(seed: int = 0):
    """Segments = prefix + tail. Prefixes: a 70-token system part S (past a KDA chunk) shared by
    all but one, branching into A or B, then each its own words; one equals S + A exactly, one is
    S alone, one is empty, one shares nothing. Returns (ids [1, T], cu_seqlens, share_ends)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 320, (n,), generator=g).tolist()

    S, A, B = rand(70), rand(12), rand(5)
    prefixes = [S + A + rand(9), S + B + rand(3), S + A, S + A + rand(20), S, [], rand(15), S + B + rand(3)]
    tails = [rand(n) for n in (6, 1, 30, 4, 11, 8, 5, 2)]
    ids, cu, ends = [], [0], []
    for p, t in zip(prefixes, tails):
        ends.append(len(ids) + len(p))
        ids += p + t
        cu.append(len(ids))
    return torch.tensor(ids)[None], torch.tensor(cu), ends


def _tail_positions(cu, ends):
    return torch.cat([torch.arange(e, b) for e, b in zip(ends, cu[1:].tolist())])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320)).train()


def test_tree_shape():
    root = _tree([[1, 2, 3], [1, 2, 4], [1, 2], [5], []])
    assert root.span == [] and root.leaves == [4]
    first = root.children[0]
    assert first.span == [1, 2] and first.leaves == [2]
    assert [c.span for c in first.children] == [[3], [4]] and [c.span for c in root.children[1:]] == [[5]]


def test_tails_equal_the_whole_forward_with_gradients(model):
    ids, cu, ends = _row()
    keep = _tail_positions(cu, ends)
    weights = torch.randn(len(keep), model.config.vocab_size, generator=torch.Generator().manual_seed(1))

    def run(shared: bool):
        model.zero_grad(set_to_none=True)
        logits = tail_logits(model, ids, cu, ends) if shared else model(ids, cu_seqlens=cu, logits_to_keep=keep)[0]
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, g_whole = run(False)
    shared, g_shared = run(True)
    torch.testing.assert_close(shared, whole, rtol=0, atol=2e-5)
    assert g_shared.keys() == g_whole.keys()
    for name, g in g_whole.items():
        err = (g_shared[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-4, (name, float(err))
    model.zero_grad(set_to_none=True)


def test_bit_exact_in_batch_invariant_mode(model):
    ids, cu, ends = _row(seed=3)
    with torch.no_grad(), batch_invariant():
        whole = model(ids, cu_seqlens=cu, logits_to_keep=_tail_positions(cu, ends))[0]
        assert torch.equal(tail_logits(model, ids, cu, ends), whole)


def test_nothing_shared_and_bad_ends(model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    cu = torch.tensor([0, 3, 6])
    assert tail_logits(model, ids, cu, [1, 4]) is None  # prefixes [5] and [8]: no token in common
    with pytest.raises(ValueError, match="inside its segment"):
        tail_logits(model, ids, cu, [3, 4])
