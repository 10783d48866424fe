"""Aux-loss-free expert balancing: the rules a trainer applies after each optimizer step (DESIGN §6).

m tokens (one step's batch), n experts, k experts per token, s [m, n] sigmoid router scores,
b [n] the selection bias `gate.e_score_correction_bias`. Everything runs under no_grad in fp32.

- DeepSeek-V3 sign update: b_j += gamma * sign(mean_load - load_j). Moves each bias by gamma per
  step, so a skew of size S in score space needs ~S/gamma steps to undo.
- K3 Quantile Balancing (QB): pick b so that, with this step's scores, every expert clears the
  token cutoff for exactly q = floor(m k / n) tokens, in one shot:
    1. a_i = (k+1)-th largest of s_i + b       (the score a token's (k+1)-th choice reaches)
    2. M_ij = s_ij - a_i                         (raw score minus the biased cutoff, DESIGN §12.2)
    3. b^_j = -((q+1)-th largest of M[:, j])     (then s_ij + b^_j > a_i for exactly q tokens)
    4. b <- b^ - mean(b^)                        (top-k is shift invariant; keep b centred)
  The new bias is used from the next step on and frozen at inference.
- Histogram QB: per expert, integer counts of M over fixed bins; counts from many ranks add up
  (all-reduce), so the pooled quantile needs no gather of scores; the midpoint of the bin holding
  the (q+1)-th largest margin is within half a bin of the exact value, so the centred bias is
  within one bin width of exact QB.

The model's gates record what these rules need (`MoEGate.last_scores`, `.expert_load`, training
mode only); `balance_step` walks a model's StableLatentMoE layers. No torch.distributed here: a
caller that shards the batch passes `reduce_fn` (e.g. an all-reduce SUM of an integer tensor).
`balance_step` and `max_load` read nothing back to the host (no bincount, no int() of a count, no
branch on a tensor's value), so a CUDA graph can capture them with the optimizer step.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k3.model.moe import StableLatentMoE

ReduceFn = Callable[[torch.Tensor], torch.Tensor]
RULES = ("quantile", "histogram", "sign")


@torch.no_grad()
def sign_update(bias: torch.Tensor, load: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3: bias + gamma * sign(mean_load - load) (a new tensor). load [n] token counts."""
    load = load.float()
    return bias + gamma * torch.sign(load.mean() - load).to(bias.dtype)


def masked_load(idx: torch.Tensor, token_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens per expert [n] int64 of the tokens `token_mask` [m] keeps (idx [m, k]); a weighted
    scatter-add, so nothing is read back to the host."""
    weights = token_mask[:, None].expand_as(idx).long().flatten()
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, idx.flatten(), weights)


@torch.no_grad()
def qb_margins(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """QB steps 1-2: M = s - a, a_i = the (k+1)-th largest of s_i + b. scores [m, n] -> [m, n] fp32."""
    if scores.dim() != 2 or scores.shape[1] != bias.shape[0]:
        raise ValueError(f"scores must be [tokens, {bias.shape[0]} experts], got {tuple(scores.shape)}")
    m, n = scores.shape
    if m == 0:
        raise ValueError("quantile balancing needs at least one token")
    if not 1 <= k < n:
        # k = n routes every token everywhere: there is no cutoff and nothing to balance.
        raise ValueError(f"quantile balancing needs 1 <= k < num_experts={n}, got k={k}")
    s = scores.float()
    cutoff = torch.topk(s + bias.float(), k + 1, dim=-1).values[:, k]
    return s - cutoff[:, None]


def qb_quota(m: int | torch.Tensor, n: int, k: int) -> int | torch.Tensor:
    """q = floor(m k / n): tokens per expert under perfect balance. k < n gives q < m, so the
    (q+1)-th largest of m margins always exists."""
    return m * k // n


@torch.no_grad()
def bias_from_quantiles(quantiles: torch.Tensor) -> torch.Tensor:
    """QB steps 3-4: b^ = -quantile, centred."""
    b = -quantiles
    return b - b.mean()


@torch.no_grad()
def quantile_balance(scores: torch.Tensor, bias: torch.Tensor, k: int,
                     token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact K3 QB on one batch: the new bias [n] (replaces `bias`, same dtype). `token_mask` [m]:
    only these tokens count (a captured step's padding does not), with no host read."""
    margins = qb_margins(scores, bias, k)
    m, n = margins.shape
    if token_mask is None:
        # (q+1)-th largest of m values = (m-q)-th smallest
        quantiles = torch.kthvalue(margins, m - qb_quota(m, n, k), dim=0).values
    else:  # masked tokens sort last; the quota counts the kept ones, on the device
        q = qb_quota(token_mask.sum(), n, k)
        ranked = margins.masked_fill(~token_mask[:, None], float("-inf")).sort(dim=0, descending=True).values
        quantiles = ranked.gather(0, q.view(1, 1).expand(1, n))[0]
    return bias_from_quantiles(quantiles).to(bias.dtype)


def margin_edges(bins: int = 1000, lo: float = -1.0, hi: float = 1.0, device=None) -> torch.Tensor:
    """bins+1 fixed edges. Scores lie in (0, 1) so |margin| < 1 + max|b|; the quantile QB needs
    sits near -b_j, well inside [-1, 1] for any useful bias. Outliers land in the end bins."""
    return torch.linspace(lo, hi, bins + 1, device=device, dtype=torch.float32)


@torch.no_grad()
def margin_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, edges: torch.Tensor,
                     token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert, counts of QB margins per bin: [n, bins] int64, summable across ranks (only the
    tokens `token_mask` [m] keeps, when given)."""
    margins = qb_margins(scores, bias, k)
    n, bins = margins.shape[1], edges.numel() - 1
    # interior edges only: values below edges[1] go to bin 0, values >= edges[-2] to the last bin
    which = torch.bucketize(margins, edges[1:-1].to(margins.device), right=True)
    flat = (which + torch.arange(n, device=margins.device) * bins).flatten()
    # a scatter-add, not torch.bincount: bincount's CUDA kernel reads max() back to the host
    ones = torch.ones_like(flat) if token_mask is None else token_mask[:, None].expand_as(which).long().flatten()
    counts = torch.zeros(n * bins, dtype=torch.long, device=margins.device).scatter_add_(0, flat, ones)
    return counts.view(n, bins)


@torch.no_grad()
def quantile_from_histogram(counts: torch.Tensor, edges: torch.Tensor, q: int | torch.Tensor) -> torch.Tensor:
    """Per expert, the midpoint of the bin holding the (q+1)-th largest margin: [n] fp32. An int q
    is checked against the tokens counted (a host read); a 0-d tensor q (on counts' device, as
    `histogram_balance` computes it) is not, so nothing is read back."""
    from_top = counts.flip(-1).cumsum(-1)  # tokens at or above each bin, highest bin first
    if isinstance(q, torch.Tensor):
        target = (q + 1).to(from_top.dtype).expand(counts.shape[0], 1).contiguous()
    else:
        m = int(counts[0].sum())
        if not 0 <= q < m:
            raise ValueError(f"need 0 <= q < tokens counted ({m}), got q={q}")
        target = torch.full((counts.shape[0], 1), q + 1, device=counts.device, dtype=from_top.dtype)
    bin_from_top = torch.searchsorted(from_top, target).squeeze(-1)
    b = counts.shape[-1] - 1 - bin_from_top
    edges = edges.to(counts.device)
    return (edges[b] + edges[b + 1]) / 2


@torch.no_grad()
def histogram_balance(counts: torch.Tensor, edges: torch.Tensor, k: int) -> torch.Tensor:
    """QB from (pooled) margin histograms [n, bins]: the new bias [n] fp32."""
    # the pooled token count stays on the device: ranks' shares are not known here
    n, m = counts.shape[0], counts[0].sum()
    return bias_from_quantiles(quantile_from_histogram(counts, edges, qb_quota(m, n, k)))


def moe_layers(model: nn.Module) -> dict[str, StableLatentMoE]:
    return {name: module for name, module in model.named_modules() if isinstance(module, StableLatentMoE)}


@torch.no_grad()
def balance_step(model: nn.Module, rule: str | None = "quantile", *, gamma: float = 1e-3,
                 edges: torch.Tensor | None = None, reduce_fn: ReduceFn | None = None,
                 token_mask: torch.Tensor | None = None) -> None:
    """Update every MoE layer's selection bias from what its gate recorded in the training forwards
    since the previous call (all micro-batches of the step). rule: "quantile" (exact QB, this process's tokens only), "histogram" (QB from margin
    histograms, `reduce_fn` pools them across ranks), "sign" (DeepSeek-V3, `reduce_fn` pools the
    loads), None (no update). `token_mask` [m] bool: the recorded tokens that count, in record
    order (a captured step's pad tokens do not: the eager step has none). Frees the records either way."""
    if rule is None:
        for moe in moe_layers(model).values():  # nothing to apply, but the step's records end here
            moe.gate.clear_records()
        return
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES} or None, got {rule!r}")
    if rule == "quantile" and reduce_fn is not None:
        raise ValueError("rule='quantile' sees only local scores; use rule='histogram' with reduce_fn to pool ranks")
    for name, moe in moe_layers(model).items():
        gate = moe.gate
        if gate.last_scores is None:
            raise RuntimeError(f"{name}: no recorded router scores; run a forward in training mode before balance_step")
        bias = gate.e_score_correction_bias
        if rule == "sign":
            load = gate.expert_load if token_mask is None else masked_load(gate.last_indices, token_mask,
                                                                          gate.num_experts)
            load = load if reduce_fn is None else reduce_fn(load.clone())
            new = sign_update(bias, load, gamma)
        elif rule == "quantile":
            new = quantile_balance(gate.last_scores, bias, gate.top_k, token_mask)
        else:
            bin_edges = margin_edges(device=bias.device) if edges is None else edges
            counts = margin_histogram(gate.last_scores, bias, gate.top_k, bin_edges, token_mask)
            if reduce_fn is not None:
                counts = reduce_fn(counts)
            new = histogram_balance(counts, bin_edges, gate.top_k)
        bias.copy_(new)
        gate.clear_records()


def expert_loads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tokens routed to each expert since the last balance_step, per MoE layer (for logging)."""
    return {name: moe.gate.expert_load for name, moe in moe_layers(model).items() if moe.gate.expert_load is not None}


@torch.no_grad()
def max_load(model: nn.Module, token_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """max/mean of each MoE layer's expert load since the last balance_step, stacked [layers] fp32
    on the device (None when nothing is recorded): the trainer reads it back only when it logs.
    Call it before balance_step, which clears the loads. `token_mask`: as balance_step's."""
    loads = list(expert_loads(model).values()) if token_mask is None else [
        masked_load(moe.gate.last_indices, token_mask, moe.gate.num_experts)
        for moe in moe_layers(model).values() if moe.gate.last_indices is not None]
    if not loads:
        return None
    return torch.stack([load.max().float() / load.float().mean().clamp_min(1e-9) for load in loads])
