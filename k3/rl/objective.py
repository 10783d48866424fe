"""The per-token RL objective: group-relative advantages, a clipped importance ratio against the
behaviour policy, an optional KL to a reference, and the trainer's packed log-probs (DESIGN §13.2).

Per completion token t of trajectory i (docs/RL.md has the derivation):

    A_i     = r_i - mean_{j in group(i)} r_j            (optionally / (std_group + eps); 0 if the group's rewards are all equal)
    rho_t   = exp(log pi(y_t) - log mu(y_t))            mu: the behaviour policy that sampled y_t (rollout log-probs)
    l_t     = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)
            + beta * k3_t,   k3_t = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1

Partial rollout trains on tokens sampled by older policies (DESIGN §13.2: "K3 uses per-token
regularization to bound the local change of the policy update"): the clip bounds how far each
token's probability can move relative to the policy that actually sampled it, whatever its age.

k3_t is Schulman's "k3" estimator of KL(pi || pi_ref): unbiased on tokens drawn from pi, always
>= 0, and with low variance; its gradient pulls log pi toward log pi_ref token by token.

Averaging: token-level by default (every completion token of the batch weighs the same; the sum is
divided by the number of completion tokens, or by `num_tokens` when a global batch is split into
micro-batches). Why: the regularization is per token (DESIGN §13.2), and effort control (DESIGN
§13.2) punishes length itself, which a per-sequence mean (each trajectory weighted 1, its tokens
1/|y_i|) would dilute exactly on the long trajectories it targets. "sequence" (the mean over
trajectories of each one's token mean) is available for comparison.

log pi(y_t) is of pi_T = softmax(z / T) at the rollout's sampling temperature T, before any top-k
/ top-p truncation: the same quantity the rollout records (k3/rl/rollout.py), so rho_t = 1 exactly
when the weights have not moved and the arithmetic is the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.ops import host_free
from k3.ops.batch_invariant import batch_invariant as batch_invariant_mode
from k3.rl.shared_prompts import shared_prompt_logits
from k3.train.graph_step import pad_batch
from k3.train.packing import PackedBatch

AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class ObjectiveConfig:
    eps_low: float = 0.2  # ratio floor 1 - eps_low (binds where the advantage is negative)
    eps_high: float = 0.2  # ratio ceiling 1 + eps_high (binds where the advantage is positive)
    kl_coef: float = 0.0  # beta: weight of the per-token k3 KL to the reference (0: no reference needed)
    aggregation: str = "token"  # "token" or "sequence" (module docstring says why token)

    def __post_init__(self):
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")


def group_advantages(rewards, groups: Sequence, *, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Per-trajectory advantages [N] (fp32): reward minus its group's mean reward, optionally
    divided by the group's standard deviation (population, over the group's members) + eps.
    `groups`: a group key per trajectory (e.g. `Trajectory.group_id`); groups may differ in size.
    A group whose rewards are all equal (including a group of one) gets exactly 0: it says nothing
    about which completion was better."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(groups) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(groups)} group keys")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    keys = {key: n for n, key in enumerate(dict.fromkeys(groups))}
    g = torch.tensor([keys[key] for key in groups], dtype=torch.long)
    count = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, g, r) / count
    centred = r - mean[g]
    lo = torch.full((len(keys),), float("inf"), dtype=torch.float64).scatter_reduce(0, g, r, "amin")
    hi = torch.full((len(keys),), float("-inf"), dtype=torch.float64).scatter_reduce(0, g, r, "amax")
    if normalize_std:
        var = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, g, centred ** 2) / count
        centred = centred / (var.sqrt()[g] + eps)
    return torch.where((hi == lo)[g], 0.0, centred).float()


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                config: ObjectiveConfig = ObjectiveConfig(), *, seq_ids: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                num_tokens: float | None = None, num_sequences: float | None = None) -> tuple[torch.Tensor, dict]:
    """The loss (a scalar to minimize) and its metrics. Every per-token tensor has the same shape
    (e.g. [T] of a packed row, or [B, T] padded): `logprobs` the trainer's log pi_T (with grad),
    `old_logprobs` the behaviour log-probs, `advantages` each token's trajectory advantage, `mask`
    True on the completion tokens that count (prompt and padding positions are False: whatever
    they hold, NaN included, never reaches the loss or its gradient). `seq_ids`: the trajectory of
    each token (needed for "sequence" averaging). `ref_logprobs`: needed when kl_coef > 0.
    `entropy`: per-token entropies, reported only. `num_tokens` / `num_sequences`: the
    denominator of the global batch when this is one micro-batch of it (default: this batch's).

    Metrics (token means over the mask, whatever the aggregation): ratio mean / max, clip fractions
    (low: A < 0 and rho < 1 - eps_low; high: A > 0 and rho > 1 + eps_high; their sum: the tokens
    whose gradient the clip removes), behaviour_kl (k3 estimate of KL(mu || pi): how far the policy has moved
    from the one that sampled the tokens),
    kl (k3 to the reference), entropy, pg_loss (the surrogate part of the loss), tokens."""
    loss, metrics = policy_terms(logprobs, old_logprobs, advantages, mask, config, seq_ids=seq_ids,
                                 ref_logprobs=ref_logprobs, entropy=entropy, num_tokens=num_tokens,
                                 num_sequences=num_sequences)
    return loss, {k: int(v) if k == "tokens" else float(v) for k, v in metrics.items()}


def policy_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 config: ObjectiveConfig = ObjectiveConfig(), *, seq_ids: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                 num_tokens: float | torch.Tensor | None = None,
                 num_sequences: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with its metrics as 0-d device tensors: with "token" aggregation nothing is
    read back to the host (a captured step runs it, k3/train/graph_step.py); `num_tokens` may be
    a device scalar, the captured step's input."""
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask),
                    ("seq_ids", seq_ids), ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if config.aggregation == "sequence" and seq_ids is None:
        raise ValueError('aggregation "sequence" needs seq_ids')
    m = mask.bool()
    zero = logprobs.new_zeros(())
    # masked positions are replaced before any arithmetic, so their values (and NaN) never matter
    log_ratio = torch.where(m, logprobs - old_logprobs.to(logprobs.dtype), zero)
    adv = torch.where(m, advantages.to(logprobs.dtype), zero)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        d = torch.where(m, ref_logprobs.to(logprobs.dtype) - logprobs, zero)
        kl = torch.exp(d) - d - 1.0
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    n_tok = m.sum()
    if config.aggregation == "token":
        denom = n_tok.clamp(min=1) if num_tokens is None else num_tokens
        denom = denom if isinstance(denom, torch.Tensor) else float(denom)
        loss = torch.where(m, per_token, zero).sum() / denom
        pg_loss = torch.where(m, pg, zero).sum().detach() / denom
    else:  # per-trajectory means: sized by the batch's trajectories, so read on the host
        ids = torch.unique(seq_ids[m], return_inverse=True)[1]
        n_seq = int(ids.max()) + 1 if int(n_tok) else 0
        denom = float(num_sequences) if num_sequences is not None else max(n_seq, 1)
        counts = torch.zeros(n_seq, dtype=per_token.dtype, device=per_token.device).index_add_(
            0, ids, torch.ones_like(per_token[m]))
        loss = (per_token.new_zeros(n_seq).index_add(0, ids, per_token[m]) / counts).sum() / denom
        pg_loss = (pg.new_zeros(n_seq).index_add(0, ids, pg[m].detach()) / counts).sum() / denom
    with torch.no_grad():
        count = n_tok.clamp(min=1)

        def mean(x: torch.Tensor) -> torch.Tensor:  # over the mask; 0 without tokens
            return torch.where(m, x.float(), 0.0).sum() / count

        low = m & (adv < 0) & (ratio < 1.0 - config.eps_low)
        high = m & (adv > 0) & (ratio > 1.0 + config.eps_high)
        stale = ratio - 1.0 - log_ratio  # k3 estimate of KL(mu || pi) on tokens drawn from mu
        metrics = {"loss": loss.detach(), "pg_loss": pg_loss, "ratio_mean": mean(ratio),
                   "ratio_max": torch.where(m, ratio, zero).amax(),  # ratios are > 0: 0 without tokens
                   "clip_fraction": mean(low | high), "clip_low_fraction": mean(low),
                   "clip_high_fraction": mean(high), "behaviour_kl": mean(stale), "tokens": n_tok}
        if kl is not None:
            metrics["kl"] = mean(kl)
        if entropy is not None:
            metrics["entropy"] = mean(entropy)
    return loss, metrics


@dataclass
class RLBatch:
    """Trajectories packed into one row (each its own cu_seqlens segment: prompt + completion, minus
    the last token), and per-position tensors [T] aligned with it: position p predicts targets[p];
    mask[p] is True where that target is a completion token."""
    input_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [N + 1]
    targets: torch.Tensor  # [T]
    mask: torch.Tensor  # [T] bool
    old_logprobs: torch.Tensor  # [T] fp32, behaviour log-probs (0 off the mask)
    advantages: torch.Tensor  # [T] fp32, the trajectory's advantage (0 off the mask)
    seq_ids: torch.Tensor  # [T] long, the trajectory of each position
    versions: torch.Tensor  # [T] long, policy version that sampled the target (-1 off the mask)

    def to(self, device) -> RLBatch:
        return RLBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def pad_rl_batch(batch: RLBatch, tokens: int, docs: int, pad_id: int) -> RLBatch:
    """`batch` as a row of exactly `tokens` positions and `docs` documents, the shape a captured
    step takes (k3.train.graph_step.pad_batch: the pad positions form one more document, then
    zero-length ones): pad positions predict `pad_id` and are off the mask (advantage and
    behaviour log-prob 0, no trajectory: seq id -1, version -1), so they change nothing."""
    row = pad_batch(PackedBatch(batch.input_ids, batch.targets[None], batch.cu_seqlens), tokens, docs, pad_id)
    n = tokens - batch.targets.numel()

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, t.new_full((n,), value)])

    return RLBatch(row.input_ids, row.cu_seqlens, pad(batch.targets, pad_id), pad(batch.mask, False),
                   pad(batch.old_logprobs, 0.0), pad(batch.advantages, 0.0), pad(batch.seq_ids, -1),
                   pad(batch.versions, -1))


def trained_tokens(trajectory) -> int:
    """The completion tokens a trajectory trains (an episode row masks its tool results out)."""
    mask = getattr(trajectory, "completion_mask", None)
    return sum(mask) if mask is not None else len(trajectory.completion_ids)


def pack_trajectories(trajectories: Sequence, advantages: Sequence[float] | torch.Tensor) -> RLBatch:
    """One packed row from trajectories (anything with prompt_ids, completion_ids, logprobs,
    versions, and optionally a completion_mask of the tokens it trains: k3.rl.rollout.Trajectory,
    k3.rl.episode_rows.EpisodeRow), each with its advantage."""
    adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if adv.numel() != len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories but {adv.numel()} advantages")
    ids, targets, mask, old, a, seq, ver, cu = [], [], [], [], [], [], [], [0]
    for n, t in enumerate(trajectories):
        prompt, completion = list(t.prompt_ids), list(t.completion_ids)
        if not prompt or not completion:
            raise ValueError(f"trajectory {n} needs a prompt and at least one completion token")
        if not len(t.logprobs) == len(t.versions) == len(completion):
            raise ValueError(f"trajectory {n}: {len(completion)} completion tokens, {len(t.logprobs)} log-probs, "
                             f"{len(t.versions)} versions")
        trains = list(getattr(t, "completion_mask", None) or [True] * len(completion))
        if len(trains) != len(completion) or not any(trains):
            raise ValueError(f"trajectory {n}: its completion mask must cover its completion and train a token")
        seqn = prompt + completion
        P, L = len(prompt), len(seqn) - 1
        ids += seqn[:-1]
        targets += seqn[1:]
        mask += [False] * (P - 1) + trains
        old += [0.0] * (P - 1) + list(t.logprobs)
        a += [0.0] * (P - 1) + [float(adv[n]) if k else 0.0 for k in trains]
        ver += [-1] * (P - 1) + list(t.versions)
        seq += [n] * L
        cu.append(cu[-1] + L)
    return RLBatch(torch.tensor(ids, dtype=torch.long)[None], torch.tensor(cu, dtype=torch.long),
                   torch.tensor(targets, dtype=torch.long), torch.tensor(mask, dtype=torch.bool),
                   torch.tensor(old, dtype=torch.float32), torch.tensor(a, dtype=torch.float32),
                   torch.tensor(seq, dtype=torch.long), torch.tensor(ver, dtype=torch.long))


def token_logprobs(model, batch: RLBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                   batch_invariant: bool = False, share_prompts: bool = False):
    """The trainer's log pi_T of every target [T] (0 off the mask; differentiable), and with
    `with_entropy` the per-position entropy of pi_T [T] (detached). One packed forward with
    cu_seqlens (trajectories never see each other); logits only at the masked positions.
    `batch_invariant`: compute in k3.ops.batch_invariant's arithmetic (CPU), the same as a
    batch-invariant rollout engine: the recomputed log-probs then equal the rollout's bit for bit,
    QAT included (elsewhere an ulp of difference upstream can flip an MXFP8 rounding).
    `share_prompts`: prompt tokens several trajectories share run once (k3/rl/shared_prompts.py).
    In host-free mode (a captured step, k3/ops/host_free.py) logits are computed at every
    position: which ones the mask keeps is data the host would have to read."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if host_free.active():
        return _dense_logprobs(model, batch, temperature, with_entropy, share_prompts or batch_invariant)
    keep = batch.mask.nonzero()[:, 0]
    with batch_invariant_mode(batch_invariant):
        logits = shared_prompt_logits(model, batch) if share_prompts else None
        if logits is None:
            logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, logits_to_keep=keep)[0]  # [P, V] fp32
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        chosen = logp.gather(1, batch.targets[keep][:, None])[:, 0]
    out = chosen.new_zeros(batch.targets.shape).index_copy(0, keep, chosen)
    if not with_entropy:
        return out
    with torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)
        entropy = ent.new_zeros(batch.targets.shape).index_copy(0, keep, ent)
    return out, entropy


def _dense_logprobs(model, batch: RLBatch, temperature: float, with_entropy: bool, refused: bool):
    """`token_logprobs` of a padded row in host-free mode: every position's logits, kept by the mask."""
    if refused:
        raise ValueError("share_prompts and batch_invariant read the batch on the host: not in host-free mode")
    logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens)[0]  # [T, V] fp32
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    zero = logp.new_zeros(())
    out = torch.where(batch.mask, logp.gather(1, batch.targets[:, None])[:, 0], zero)
    if not with_entropy:
        return out
    with torch.no_grad():
        return out, torch.where(batch.mask, -(logp.exp() * logp).sum(-1), zero)
