"""pack / unpack (k3/ops/varlen.py): inverse of each other on ragged and uniform batches, padding
zero, and gradients that pass through unchanged (each token's gradient lands on that token only)."""
import pytest
import torch

from k3.ops.varlen import pack, unpack


@pytest.mark.parametrize("lengths", [[3, 5, 0, 7], [4, 4], [1], [6, 2, 9]])
@pytest.mark.parametrize("multiple", [1, 4])
def test_unpack_pack_round_trip(lengths, multiple):
    torch.manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, sum(lengths), 3, 2, requires_grad=True)
    padded = unpack(x, cu, multiple)
    assert padded.shape[1] % multiple == 0 and padded.shape[1] >= max(lengths)
    for n, (start, length) in enumerate(zip(cu.tolist(), lengths)):
        assert torch.equal(padded[n, :length], x[0, start:start + length])
        assert not padded[n, length:].any()
    assert torch.equal(pack(padded, cu), x)
    weights = torch.randn_like(x)
    (grad,) = torch.autograd.grad((pack(padded * 2, cu) * weights).sum(), x)
    assert torch.equal(grad, 2 * weights)


@pytest.mark.parametrize("lengths", [[4, 4], [3, 5]])
def test_results_are_contiguous_whatever_the_input_layout(lengths):
    """Later products take another BLAS kernel on strided inputs (another rounding, which
    batch-invariant mode pins): pack and unpack always return contiguous tensors."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, 3, sum(lengths)).transpose(1, 2)  # strided, as the short conv's output
    padded = unpack(x, cu)
    assert padded.is_contiguous() and torch.equal(pack(padded, cu), x)
    y = torch.randn(len(lengths), 3, max(lengths)).transpose(1, 2)
    assert pack(y, cu).is_contiguous()
