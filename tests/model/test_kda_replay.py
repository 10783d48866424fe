"""Speculative rollback by replay (DESIGN §11): the state a KDA layer reaches after the first a + 1
tokens of a verification forward, rebuilt from the state before it and the forward's kept inputs
(`KimiDeltaAttention.replay`), equals the state saved at that position by running the tokens one
at a time, for every accepted length 0..k, in a packed batch whose sequences accept different
lengths; the conv-tail gather equals its per-sequence reference."""
from __future__ import annotations

import pytest
import torch

from k3.model.cache import KDAInputs, KDAState
from k3.ops.kda.replay import replay_tails, replay_tails_reference
from tests.helpers import assert_rel_close
from tests.helpers.kda import D, clone_state, make_layer, random_state

K_DRAFT = 6


def _per_position_states(layer, x, state: KDAState) -> list[KDAState]:
    """The reference rollback: the state after each token, one decode step at a time."""
    s, out = clone_state(state), []
    with torch.no_grad():
        for t in range(x.shape[1]):
            layer(x[:, t:t + 1], state=s)
            out.append(clone_state(s))
    return out


def _check(layer, device, dtype, tol):
    torch.manual_seed(0)
    N, T = 3, K_DRAFT + 1
    x = torch.randn(1, N * T, D, device=device, dtype=dtype)
    before = random_state(layer.config, N)
    before = KDAState(before.conv.to(device, dtype), before.recurrent.to(device))
    cu = torch.arange(N + 1, device=device) * T
    verify = clone_state(before)
    verify.record = KDAInputs()
    with torch.no_grad():
        layer(x, cu_seqlens=cu, state=verify)  # the verification forward, all k + 1 tokens
    saved = [_per_position_states(layer, x[:, n * T:(n + 1) * T], KDAState(before.conv[n:n + 1], before.recurrent[n:n + 1]))
             for n in range(N)]
    for shift in range(T):  # sequence n accepts (shift + n) % T drafts: every length, mixed in one batch
        accepted = [(shift + n) % T for n in range(N)]
        rows = torch.tensor([n * T + i for n in range(N) for i in range(accepted[n] + 1)], device=device)
        kept = KDAInputs(*(t[:, rows] for t in (verify.record.conv_inputs, verify.record.k, verify.record.v,
                                                   verify.record.g_raw, verify.record.beta)))
        lengths = torch.tensor([0] + [a + 1 for a in accepted], device=device).cumsum(0)
        with torch.no_grad():
            replayed = layer.replay(kept, clone_state(before), lengths)
        for n, a in enumerate(accepted):
            ref = saved[n][a]
            assert_rel_close(f"recurrent n={n} a={a}", ref.recurrent[0].float(), replayed.recurrent[n].float(), tol)
            # the same projections, of one token or of a batch (BLAS blocking: rounding apart)
            assert_rel_close(f"conv tails n={n} a={a}", ref.conv[0].float(), replayed.conv[n].float(), tol)


@pytest.mark.parametrize("gate", ["lb", "softplus"])
def test_replay_equals_saved_states_torch(gate):
    _check(make_layer(gate).eval(), "cpu", torch.float32, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_equals_saved_states_fla():
    layer = make_layer("lb", kda_impl="fla").cuda().to(torch.bfloat16).eval()
    _check(layer, "cuda", torch.bfloat16, 1e-6)


def test_replay_tails_matches_reference():
    torch.manual_seed(1)
    tails = torch.randn(4, 6, 3)
    lengths = torch.tensor([1, 5, 2, 3])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    inputs = torch.randn(1, int(lengths.sum()), 6)
    assert torch.equal(replay_tails(tails, inputs, cu), replay_tails_reference(tails, inputs, cu))
