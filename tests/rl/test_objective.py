"""The per-token RL objective against a hand-written computation on a hand-built batch: advantages
(a zero-variance group, a group of one, unequal sizes, std normalization), ratios clipped on both
sides and left unclipped where the min keeps the raw term, masks (NaN in padding never leaks),
the k3 KL, token- vs sequence-level averaging, the gradient token by token; and the trainer's packed
log-probs: documents never see each other, the temperature divides the logits, entropy."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.rl.objective import ObjectiveConfig, group_advantages, pack_trajectories, policy_loss, token_logprobs
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)

NAN = float("nan")


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 2.0, 1.0, -1.0, 0.3]
    groups = ["a", "a", "a", "a", "b", "b", "b", "c", "c", "c", "d"]
    out = group_advantages(rewards, groups)
    expect = [0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 2 - 2 / 3, 1 - 2 / 3, -1 - 2 / 3, 0.0]
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx(expect, abs=1e-7)
    assert out[4:7].eq(0).all() and out[10] == 0  # zero variance and a group of one: exactly zero

    normed = group_advantages(rewards, groups, normalize_std=True, eps=1e-6)
    std_c = math.sqrt(sum((r - 2 / 3) ** 2 for r in (2.0, 1.0, -1.0)) / 3)
    expect_n = [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)] * 2 + [0.0] * 3 + \
               [(r - 2 / 3) / (std_c + 1e-6) for r in (2.0, 1.0, -1.0)] + [0.0]
    assert normed.tolist() == pytest.approx(expect_n, rel=1e-6, abs=1e-7)
    # rewards whose mean is not exact in binary: still exactly zero, not a rounding residue / eps
    assert group_advantages([0.1, 0.1, 0.1], [0, 0, 0], normalize_std=True).eq(0).all()
    with pytest.raises(ValueError, match="group keys"):
        group_advantages([1.0, 2.0], ["a"])


def hand_batch():
    """Two padded rows [2, 6]; row 0 has advantage +1 (4 tokens), row 1 advantage -0.5 (3 tokens).
    Ratios chosen to land on every case of the clipped min (eps 0.2 / 0.3)."""
    ratios = [[1.10, 1.50, 0.60, 1.00, NAN, NAN],  # A > 0: inside, clipped high, below floor (kept raw), 1
              [0.50, 1.60, 0.95, NAN, NAN, NAN]]  # A < 0: clipped low, above ceiling (kept raw), inside
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, NAN, 7.0], [-0.7, -1.2, -2.2, 5.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    new = torch.where(mask, old + torch.log(torch.tensor(ratios).nan_to_num(1.0)), torch.tensor(NAN))
    ref = torch.where(mask, new - torch.tensor([[0.3, -0.2, 0.1, 0.0, 0, 0], [0.5, -0.4, 0.2, 0, 0, 0]]),
                      torch.tensor(NAN))
    adv = torch.tensor([[1.0] * 6, [-0.5] * 6])
    adv[0, 5] = NAN
    seq = torch.tensor([[0] * 6, [1] * 6])
    return new, old, adv, mask, ref, seq


def by_hand(new, old, adv, mask, ref, cfg: ObjectiveConfig):
    """Per-token loss, gradient d loss_t / d logprob_t (before averaging), clip kinds, KL."""
    rows = []
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[b, t]:
                continue
            lp, o, a, r = float(new[b, t]), float(old[b, t]), float(adv[b, t]), float(ref[b, t])
            rho = math.exp(lp - o)
            clip = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
            loss = -min(rho * a, clip * a)
            clipped = (a > 0 and rho > 1 + cfg.eps_high) or (a < 0 and rho < 1 - cfg.eps_low)
            grad = 0.0 if clipped else -a * rho
            kl = math.exp(r - lp) - (r - lp) - 1
            loss += cfg.kl_coef * kl
            grad += cfg.kl_coef * (1 - math.exp(r - lp))
            rows.append({"b": b, "t": t, "loss": loss, "grad": grad, "rho": rho, "kl": kl,
                         "low": a < 0 and rho < 1 - cfg.eps_low, "high": a > 0 and rho > 1 + cfg.eps_high})
    return rows


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_policy_loss_matches_hand_computation(aggregation, kl_coef):
    cfg = ObjectiveConfig(eps_low=0.2, eps_high=0.3, kl_coef=kl_coef, aggregation=aggregation)
    new, old, adv, mask, ref, seq = hand_batch()
    lp = new.clone().requires_grad_(True)
    entropy = torch.where(mask, torch.full_like(new, 2.0), torch.tensor(NAN))
    loss, metrics = policy_loss(lp, old, adv, mask, cfg, seq_ids=seq, ref_logprobs=ref, entropy=entropy)
    loss.backward()
    rows = by_hand(new, old, adv, mask, ref, cfg)
    assert [r["high"] for r in rows] == [False, True, False, False, False, False, False]
    assert [r["low"] for r in rows] == [False, False, False, False, True, False, False]
    if aggregation == "token":  # every completion token weighs 1/7
        weight = {(r["b"], r["t"]): 1 / len(rows) for r in rows}
    else:  # each row weighs 1/2, spread over its tokens
        counts = {b: sum(r["b"] == b for r in rows) for b in (0, 1)}
        weight = {(r["b"], r["t"]): 1 / (2 * counts[r["b"]]) for r in rows}
    expect_loss = sum(r["loss"] * weight[r["b"], r["t"]] for r in rows)
    assert loss.item() == pytest.approx(expect_loss, rel=1e-6)
    grad = torch.zeros_like(new, dtype=torch.float64)
    for r in rows:
        grad[r["b"], r["t"]] = r["grad"] * weight[r["b"], r["t"]]
    assert torch.isfinite(lp.grad).all()  # NaN in padding never reaches the gradient
    torch.testing.assert_close(lp.grad.double(), grad, rtol=1e-6, atol=1e-8)
    n = len(rows)
    assert metrics["tokens"] == n
    assert metrics["clip_fraction"] == pytest.approx(2 / n)
    assert metrics["clip_low_fraction"] == pytest.approx(1 / n)
    assert metrics["clip_high_fraction"] == pytest.approx(1 / n)
    assert metrics["ratio_mean"] == pytest.approx(sum(r["rho"] for r in rows) / n, rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.6, rel=1e-6)
    assert metrics["kl"] == pytest.approx(sum(r["kl"] for r in rows) / n, rel=1e-5)
    assert metrics["behaviour_kl"] == pytest.approx(
        sum(r["rho"] - 1 - math.log(r["rho"]) for r in rows) / n, rel=1e-5)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert metrics["loss"] == pytest.approx(expect_loss, rel=1e-6)


def test_on_policy_gradient_is_the_policy_gradient():
    """rho = 1 (fresh tokens): the loss is -mean(A) and its gradient -A / n per token."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.1], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    mask = torch.tensor([True, True, True, False])
    loss, m = policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(0.0)
    assert lp.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, 2 / 3, 0.0])
    assert m["clip_fraction"] == 0 and m["ratio_mean"] == 1 and m["behaviour_kl"] == 0


def test_global_denominators_and_errors():
    new, old, adv, mask, _, seq = hand_batch()
    local, _ = policy_loss(new, old, adv, mask)
    micro, _ = policy_loss(new, old, adv, mask, num_tokens=14)  # half of a global batch of 14 tokens
    assert micro.item() == pytest.approx(local.item() * 7 / 14)
    seq_local, _ = policy_loss(new, old, adv, mask, ObjectiveConfig(aggregation="sequence"), seq_ids=seq)
    seq_micro, _ = policy_loss(new, old, adv, mask, ObjectiveConfig(aggregation="sequence"), seq_ids=seq,
                               num_sequences=4)
    assert seq_micro.item() == pytest.approx(seq_local.item() / 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(new, old, adv, mask, ObjectiveConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs seq_ids"):
        policy_loss(new, old, adv, mask, ObjectiveConfig(aggregation="sequence"))
    with pytest.raises(ValueError, match="shape"):
        policy_loss(new, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="aggregation"):
        ObjectiveConfig(aggregation="mean")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=320)).eval()


def fake_trajectory(prompt, completion, version=0):
    return SimpleNamespace(prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * len(completion),
                           versions=[version] * len(completion))


def test_packed_logprobs_equal_each_document_alone(model):
    g = torch.Generator().manual_seed(3)
    trajs = [fake_trajectory(torch.randint(3, 320, (p,), generator=g).tolist(),
                             torch.randint(3, 320, (c,), generator=g).tolist(), version=v)
             for p, c, v in ((5, 7, 0), (1, 3, 1), (12, 4, 2))]
    batch = pack_trajectories(trajs, [0.5, -1.0, 2.0])
    assert batch.cu_seqlens.tolist() == [0, 11, 14, 29]
    assert batch.mask.sum().item() == 14 and batch.versions[batch.mask].tolist() == [0] * 7 + [1] * 3 + [2] * 4
    assert batch.advantages[batch.mask].tolist() == [0.5] * 7 + [-1.0] * 3 + [2.0] * 4
    assert batch.targets[batch.mask].tolist() == [t for tr in trajs for t in tr.completion_ids]
    T = 0.7
    with torch.no_grad():
        packed, entropy = token_logprobs(model, batch, temperature=T, with_entropy=True)
        for n, tr in enumerate(trajs):
            seq = torch.tensor(tr.prompt_ids + tr.completion_ids)
            logits = model(seq[None, :-1])[0] / T  # the document alone, uniform batch path
            logp = torch.log_softmax(logits, -1)[len(tr.prompt_ids) - 1:]
            alone = logp.gather(1, seq[len(tr.prompt_ids):, None])[:, 0]
            rows = batch.mask & (batch.seq_ids == n)
            torch.testing.assert_close(packed[rows], alone, rtol=0, atol=1e-5)
            torch.testing.assert_close(entropy[rows], -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-5)
    assert packed[~batch.mask].eq(0).all()
    lp = token_logprobs(model, batch, temperature=T)
    lp.sum().backward()  # differentiable through the packed forward
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="at least one completion token"):
        pack_trajectories([fake_trajectory([1, 2], [])], [0.0])
