"""Expert balancing (DESIGN §6): K3 Quantile Balancing (exact and histogram) vs the DeepSeek-V3 sign update.

A synthetic router: scores s = sigmoid(noise + per-expert skew) for a fixed population of tokens
(noise-free dynamics: every step sees the same scores, so what is measured is the rule, not the
sampling error of a finite batch).
"""
import pytest
import torch
from torch import nn

from k3.config import load_config
from k3.model.moe import StableLatentMoE
from k3.train.balance import (
    balance_step,
    expert_loads,
    histogram_balance,
    margin_edges,
    margin_histogram,
    qb_margins,
    quantile_balance,
    quantile_from_histogram,
    sign_update,
)


def population(skew: torch.Tensor, m: int) -> torch.Tensor:
    return torch.sigmoid(torch.randn(m, skew.numel()) + skew)


def load(scores, bias, k):
    return torch.bincount(torch.topk(scores + bias, k, -1).indices.flatten(), minlength=scores.shape[1])


def imbalance(scores, bias, k) -> float:
    counts = load(scores, bias, k).float()
    return (counts.max() / counts.mean()).item()


def run_rule(update, scores, k, steps, stop_below=None):
    """Imbalance after each of `steps` updates (entry 0: before any); optionally stop once below."""
    bias, history = torch.zeros(scores.shape[1]), [imbalance(scores, torch.zeros(scores.shape[1]), k)]
    for _ in range(steps):
        bias = update(scores, bias)
        history.append(imbalance(scores, bias, k))
        if stop_below is not None and history[-1] < stop_below:
            break
    return history


def qb(k):
    return lambda s, b: quantile_balance(s, b, k)


def sign(k):
    return lambda s, b: sign_update(b, load(s, b, k))


def steps_to_balance(history, target=1.05):
    return next((i for i, v in enumerate(history) if v < target), None)


def test_qb_one_hot_expert_balances_within_three_updates_sign_does_not():
    # One expert favoured by +4 logits wins nearly every token's first slot: max/mean ~ 8.
    k, skew = 2, torch.zeros(16)
    skew[3] = 4.0
    scores = population(skew, 2048)
    qb_hist = run_rule(qb(k), scores, k, 3)
    sign_hist = run_rule(sign(k), scores, k, 1000, stop_below=1.05)
    assert qb_hist[0] > 7.0
    assert min(qb_hist[1:]) < 1.05, qb_hist
    assert sign_hist[3] > 7.0, sign_hist[:4]  # +-1e-3 per step: no visible change after 3 steps
    n_sign = steps_to_balance(sign_hist)
    assert n_sign is None or n_sign > 100, n_sign  # measured: 150 steps (QB: 7.96 -> 1.10 -> 1.05 -> 1.02)


def test_qb_broad_skew_converges_in_a_few_updates_sign_in_hundreds():
    # Every expert skewed (logit offsets -2..2): QB's cutoffs move when all biases move at once,
    # so it is a fixed-point iteration (error roughly halves per update) rather than one shot.
    # Measured here: 3.20 -> 1.59 -> 1.14 -> 1.07 -> 1.04; the sign update needs 357 steps.
    k, skew = 2, torch.linspace(-2, 2, 8)
    scores = population(skew, 2048)
    qb_hist = run_rule(qb(k), scores, k, 6)
    sign_hist = run_rule(sign(k), scores, k, 1000, stop_below=1.05)
    assert qb_hist[0] > 3.0 and qb_hist[3] < 1.15 and min(qb_hist[4:]) < 1.05, qb_hist
    assert sign_hist[6] > 2.5, sign_hist[:7]
    n_sign = steps_to_balance(sign_hist)
    assert n_sign is None or n_sign > 100, n_sign
    # and a lower bound that needs no simulation: each sign step moves each bias by exactly gamma,
    # and the balanced bias spans (max - min) / 2 >> 3 * gamma.
    balanced = scores.new_zeros(8)
    for _ in range(10):
        balanced = quantile_balance(scores, balanced, k)
    assert (balanced.max() - balanced.min()) / 2 / 1e-3 > 100


def test_qb_in_sample_quota_and_centring():
    # The defining property: with the new bias and this batch's (old) cutoffs, every expert clears
    # the cutoff for exactly q = floor(m k / n) tokens.
    m, n, k = 1000, 12, 3
    scores, bias = population(torch.randn(n), m), torch.randn(n) * 0.1
    new = quantile_balance(scores, bias, k)
    margins = qb_margins(scores, bias, k)
    quantile = margins.sort(0, descending=True).values[m * k // n]  # (q+1)-th largest per expert
    uncentred = -quantile
    assert (new - uncentred).std() < 1e-6  # b = b^ - mean(b^)
    assert ((margins > -uncentred).sum(0) == m * k // n).all()
    assert abs(new.mean().item()) < 1e-6 and new.dtype == bias.dtype
    # replaced, not stepped: the result does not depend on the old bias' mean
    assert torch.allclose(new, quantile_balance(scores, bias + 0.3, k), atol=1e-6)


def test_histogram_matches_exact_within_one_bin_and_pools_across_ranks():
    m, n, k = 3000, 16, 2
    scores = population(torch.linspace(-2, 2, n), m)
    bias = quantile_balance(scores, torch.zeros(n), k)  # a non-trivial current bias
    edges = margin_edges()
    width = (edges[1] - edges[0]).item()
    exact = quantile_balance(scores, bias, k)
    counts = margin_histogram(scores, bias, k, edges)
    assert counts.dtype == torch.int64 and counts.shape == (n, 1000) and (counts.sum(1) == m).all()
    approx = histogram_balance(counts, edges, k)
    assert (approx - exact).abs().max() <= width, (approx - exact).abs().max()
    # three "ranks" with uneven shards: summed integer counts are the whole batch's counts
    shards = [margin_histogram(part, bias, k, edges) for part in scores.split([1000, 1500, 500])]
    assert torch.equal(sum(shards), counts)
    # quantile_from_histogram: the midpoint of the bin holding the (q+1)-th largest margin
    q = m * k // n
    true_q = torch.kthvalue(qb_margins(scores, bias, k), m - q, dim=0).values
    assert (quantile_from_histogram(counts, edges, q) - true_q).abs().max() <= width / 2 + 1e-6


def test_bad_inputs_are_clear_errors():
    scores = torch.rand(10, 4)
    with pytest.raises(ValueError, match="k < num_experts"):
        quantile_balance(scores, torch.zeros(4), 4)
    with pytest.raises(ValueError, match="tokens, 5 experts"):
        quantile_balance(scores, torch.zeros(5), 2)
    with pytest.raises(ValueError, match="at least one token"):
        quantile_balance(torch.rand(0, 4), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="q < tokens"):
        quantile_from_histogram(torch.ones(4, 10, dtype=torch.long), margin_edges(10), 10)


def tiny_moe_model() -> nn.Module:
    cfg = load_config("k3-tiny").replace(hidden_size=32, routed_expert_hidden_size=16, num_experts=8,
                                         num_experts_per_token=2)
    return nn.ModuleDict({"a": StableLatentMoE(cfg), "b": StableLatentMoE(cfg)})


@pytest.mark.parametrize("rule", ["quantile", "histogram", "sign"])
def test_balance_step_updates_every_layer_from_recorded_scores(rule):
    model = tiny_moe_model()
    with torch.no_grad():
        model["a"].gate.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(4, 50, 32)
    with pytest.raises(RuntimeError, match="training mode"):
        balance_step(model, rule)
    model.train()
    for layer in model.values():
        layer(x)
    recorded = {name: (layer.gate.last_scores, layer.gate.e_score_correction_bias.clone(), layer.gate.expert_load)
                for name, layer in model.items()}
    loads = expert_loads(model)
    assert set(loads) == {"a", "b"} and all(v.sum() == 200 * 2 for v in loads.values())
    reduced = []

    def reduce_fn(t):  # stands in for an all-reduce over ranks
        reduced.append(t.dtype)
        return t * 2

    balance_step(model, rule, reduce_fn=None if rule == "quantile" else reduce_fn)
    for name, layer in model.items():
        scores, old, count = recorded[name]
        expected = {"quantile": lambda scores=scores, old=old: quantile_balance(scores, old, 2),
                    "histogram": lambda scores=scores, old=old: histogram_balance(margin_histogram(scores, old, 2, margin_edges()) * 2,
                                                           margin_edges(), 2),
                    "sign": lambda old=old, count=count: sign_update(old, count * 2)}[rule]()
        assert torch.equal(layer.gate.e_score_correction_bias, expected)
        assert layer.gate.last_scores is None  # consumed
    assert reduced == ([] if rule == "quantile" else [torch.int64, torch.int64])


def test_balance_step_rules_and_noop():
    model = tiny_moe_model()
    balance_step(model, None)  # nothing recorded, nothing done
    with pytest.raises(ValueError, match="rule must be"):
        balance_step(model, "aux_loss")
    with pytest.raises(ValueError, match="histogram"):
        balance_step(model, "quantile", reduce_fn=lambda t: t)


def test_micro_batches_of_one_step_are_balanced_together():
    """QB balances the step's m tokens (DESIGN §6): two micro-batches = one batch of both."""
    import copy

    cfg = load_config("k3-tiny").replace(hidden_size=32, num_experts=8, num_experts_per_token=2,
                                         moe_intermediate_size=16, routed_expert_hidden_size=16)
    torch.manual_seed(0)
    split = StableLatentMoE(cfg).train()
    whole = copy.deepcopy(split)
    x = torch.randn(64, 32)
    split(x[:40])
    split(x[40:])
    whole(x)
    assert int(split.gate.expert_load.sum()) == 64 * 2
    balance_step(split, "quantile")
    balance_step(whole, "quantile")
    assert torch.equal(split.gate.e_score_correction_bias, whole.gate.e_score_correction_bias)
    assert split.gate.last_scores is None and split.gate.expert_load is None


def test_masked_balance_counts_only_the_kept_tokens():
    """A captured step's pad tokens must not move the bias: every rule over scores with extra
    masked rows = the rule over the kept rows alone (QB's sort path = its kthvalue path exactly)."""
    from k3.train.balance import margin_edges, margin_histogram, masked_load, quantile_balance

    g = torch.Generator().manual_seed(0)
    scores, bias = torch.rand(300, 8, generator=g), torch.randn(8, generator=g) * 0.1
    pads = torch.rand(37, 8, generator=g)
    mask = torch.cat([torch.ones(300, dtype=torch.bool), torch.zeros(37, dtype=torch.bool)])
    padded = torch.cat([scores, pads])
    assert torch.equal(quantile_balance(padded, bias, 2, mask), quantile_balance(scores, bias, 2))
    assert torch.equal(quantile_balance(scores, bias, 2, torch.ones(300, dtype=torch.bool)),
                       quantile_balance(scores, bias, 2))
    edges = margin_edges()
    assert torch.equal(margin_histogram(padded, bias, 2, edges, mask), margin_histogram(scores, bias, 2, edges))
    idx = torch.topk(padded, 2, dim=-1).indices
    assert torch.equal(masked_load(idx, mask, 8), torch.bincount(idx[:300].flatten(), minlength=8))
