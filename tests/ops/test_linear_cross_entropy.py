"""The fused LM head + cross-entropy's torch reference (k3/ops/linear_cross_entropy.py) against the
plain formula; fla's CUDA path against it: tests/ops/test_linear_cross_entropy_gpu.py."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from k3.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from tests.helpers import assert_rel_close

EXACT = 1e-6


def head_inputs(n: int = 13, d: int = 16, v: int = 50):
    """h [n, d], weight [v, d] (both requiring grad), labels [n] with every 3rd position ignored."""
    h = torch.randn(n, d, requires_grad=True)
    weight = (torch.randn(v, d) * d ** -0.5).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[::3] = -100
    return h, weight, labels


def loss_and_grads(loss_fn, h, weight, labels):
    loss = loss_fn(h, weight, labels)
    return [loss, *torch.autograd.grad(loss, (h, weight))]


@pytest.mark.parametrize("chunk", [4, 13, 64], ids=["ragged", "one-chunk-exact", "one-chunk"])
def test_chunked_reference_equals_plain_formula(chunk):
    """Loss and the gradients of h and the weight; chunk sizes that do and don't divide N."""
    h, weight, labels = head_inputs()
    ref = loss_and_grads(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="sum"),
                         h, weight, labels)
    out = loss_and_grads(lambda h, w, y: linear_cross_entropy_reference(h, w, y, chunk=chunk), h, weight, labels)
    for name, r, o in zip(("loss", "dh", "dweight"), ref, out, strict=True):
        assert_rel_close(name, r, o, EXACT)
    assert out[0].dtype == torch.float32


def test_dispatch_without_grad_and_all_ignored():
    """The entry point on the CPU is the reference, with or without autograd; a batch with no
    target sums to 0 (not NaN, as a mean would)."""
    h, weight, labels = head_inputs()
    with torch.no_grad():
        want = F.cross_entropy(F.linear(h, weight), labels, ignore_index=-100, reduction="sum")
        assert_rel_close("no-grad loss", want, linear_cross_entropy(h, weight, labels, chunk=5), EXACT)
    assert linear_cross_entropy(h, weight, torch.full_like(labels, -100)).item() == 0.0


def test_bad_shapes_are_one_clear_error():
    h, weight, labels = head_inputs()
    with pytest.raises(ValueError, match=r"h \[N, D\]"):
        linear_cross_entropy(h, weight, labels[:-1])
    with pytest.raises(ValueError, match=r"weight \[V, D\]"):
        linear_cross_entropy(h, weight.T, labels)
