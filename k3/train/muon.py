"""Per-Head Muon for matrix weights and AdamW for the rest, as one torch optimizer (DESIGN §8).

Muon (KellerJordan; Moonlight scaling): Nesterov momentum 0.95, then each update matrix is
orthogonalized by 5 quintic Newton-Schulz steps, scaled by 0.2*sqrt(max(rows, cols)) so its RMS
matches AdamW's (one learning rate serves both), with decoupled weight decay `p *= 1 - lr*wd`.
Per-Head Muon (K3, DESIGN §8/§12.6): the projections that produce or consume attention heads are
orthogonalized head block by head block — row blocks for the weights that produce heads (KDA
q/k/v/g, MLA q_b (or q), kv_b, g), column blocks for the o_proj that consumes them — and the
scale comes from the block's shape. Every other 2-D weight is orthogonalized whole (router,
each routed expert of a stacked bank, dense FFN, low-rank factors). Embeddings, lm_head, norms, biases, A_log, dt_bias, the
AttnRes pseudo-queries (`*_res_proj`) and non-matrix weights (convs [C, 1, W]) use AdamW.
The router's `e_score_correction_bias` is a buffer moved by balancing, never by this optimizer.
`param_groups(..., optimizer=)` also builds the two common alternatives (for `k3 ablate`): "muon"
orthogonalizes every Muon weight whole (no head blocks), "adamw" puts every parameter in AdamW.

Why not torch.optim.Muon: it orthogonalizes whole 2-D matrices only (no block structure) and its
Newton-Schulz is a private 2-D helper; here the blocks of a weight run as one batched NS.
Under FSDP2 a Muon parameter is a sharded DTensor: the update is gathered, orthogonalized by every
rank identically, and each rank keeps its own shard (no extra communication for the write-back).

`capturable=True` makes `step()` replayable as part of a CUDA graph: each group's lr is a 0-d fp32
tensor on the parameters' device (the schedule fill_s it in place), the AdamW step counters live
there too, and the step reads nothing back to the host. State dicts hold plain float lrs either way,
so a checkpoint resumes into either mode.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import adam as torch_adam
from torch.optim.adamw import adamw

from k3.config import K3Config

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # KellerJordan's quintic, DESIGN §8
NS_STEPS = 5
NS_EPS = 1e-7
_LAYER_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(\w+)\.weight$")
_EXPERT_BANK = re.compile(r"\.experts\.w[123]$")  # stacked routed experts [E, out, in] (k3/model/experts.py)
OPTIMIZERS = ("per-head-muon", "muon", "adamw")  # K3's choice first (DESIGN §8)


@dataclass(frozen=True)
class Blocks:
    """How a Muon weight is cut: `axis` 0 = row blocks, 1 = column blocks, None = whole matrix."""
    axis: int | None = None
    size: int | None = None

    @property
    def label(self) -> str:
        return "whole" if self.axis is None else f"{'rows' if self.axis == 0 else 'cols'}{self.size}"


def head_blocks(config: K3Config, name: str, param: torch.Tensor) -> Blocks | None:
    """The Muon block structure of a parameter, or None when it belongs to AdamW. A stacked expert
    bank [E, out, in] is E matrices, each orthogonalized whole."""
    if param.dim() == 3 and _EXPERT_BANK.search(name):
        return Blocks()
    if param.dim() != 2 or name.endswith("_res_proj.weight") or "embed_tokens" in name or name.startswith("lm_head"):
        return None
    match = _LAYER_PROJ.search(name)
    if match is None:
        return Blocks()
    layer, proj = int(match.group(1)), match.group(2)
    if config.is_mla_layer(layer):
        rows = {"q_b_proj": config.qk_head_dim, "q_proj": config.qk_head_dim,
                "kv_b_proj": config.qk_nope_head_dim + config.v_head_dim, "g_proj": config.v_head_dim}
        cols = {"o_proj": config.v_head_dim}
    else:
        d = config.kda_head_dim
        rows = {"q_proj": d, "k_proj": d, "v_proj": d, "g_proj": d}
        cols = {"o_proj": d}
    if proj in rows:
        return Blocks(0, rows[proj])
    if proj in cols:
        return Blocks(1, cols[proj])
    return Blocks()


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Batched orthogonalization: g [N, R, C] -> approximately U V^T of each g[n] (singular values
    pushed into the quintic's band around 1, about [0.7, 1.2]). bf16 on CUDA (as the reference
    implementation), fp32 elsewhere (CPU bf16 matmuls are slow and not needed for exactness)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def orthogonalize(update: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Newton-Schulz of each block of 2-D updates [..., R, C] (a leading dim stacks weights of one
    shape), each scaled by 0.2*sqrt(max(block rows, block cols)) (Moonlight, from the block shape)."""
    *_lead, rows, cols = update.shape
    x = update.reshape(-1, rows, cols)
    n = x.shape[0]
    if blocks.axis is None:
        return (newton_schulz(x) * (0.2 * math.sqrt(max(rows, cols)))).reshape(update.shape)
    size = blocks.size
    if (rows if blocks.axis == 0 else cols) % size:
        raise ValueError(f"a {rows}x{cols} weight cannot be cut into {blocks.label} blocks")
    if blocks.axis == 0:
        out = newton_schulz(x.reshape(n * (rows // size), size, cols)).reshape(update.shape)
        return out * (0.2 * math.sqrt(max(size, cols)))
    stacked = x.reshape(n, rows, cols // size, size).transpose(1, 2).reshape(-1, rows, size)
    out = newton_schulz(stacked).reshape(n, cols // size, rows, size).transpose(1, 2).reshape(update.shape)
    return out * (0.2 * math.sqrt(max(rows, size)))


def param_groups(model: nn.Module, config: K3Config, *, weight_decay: float,
                 optimizer: str = "per-head-muon") -> list[dict]:
    """Named groups: one Muon group per block structure, AdamW with and without decay.
    Decay applies to matrices and embeddings; never to norms, biases, A_log, dt_bias or the
    zero-initialized pseudo-queries (decay would only pull them back to the uniform average).
    `optimizer` (OPTIMIZERS): "muon" cuts no head blocks, "adamw" sends every weight to AdamW."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    groups: dict[str, dict] = {}

    def add(group_name: str, name: str, p: torch.Tensor, **extra):
        g = groups.setdefault(group_name, {"name": group_name, "params": [], "param_names": [], **extra})
        g["params"].append(p)
        g["param_names"].append(name)

    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        blocks = None if optimizer == "adamw" else head_blocks(config, name, p)
        if blocks is not None and optimizer == "muon":
            blocks = Blocks()
        if blocks is not None:
            add(f"muon_{blocks.label}", name, p, kind="muon", block_axis=blocks.axis, block_size=blocks.size,
                weight_decay=weight_decay)
        elif p.dim() >= 2 and not name.endswith("_res_proj.weight"):
            add("adamw_decay", name, p, kind="adamw", weight_decay=weight_decay)
        else:
            add("adamw_no_decay", name, p, kind="adamw", weight_decay=0.0)
    return sorted(groups.values(), key=lambda g: g["name"])


class PerHeadMuon(torch.optim.Optimizer):
    """One optimizer, two update rules selected by each group's `kind` ("muon" | "adamw").

    Muon groups carry `block_axis`/`block_size` (see `Blocks`); their state is `momentum_buffer`.
    AdamW groups use torch's functional AdamW (decoupled decay); their state is step/exp_avg/exp_avg_sq.
    `capturable`: tensor lrs and device step counters, no host reads in `step()` (module docstring).
    """

    def __init__(self, groups: list[dict], *, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 capturable: bool = False):
        for g in groups:
            if g.get("kind") not in ("muon", "adamw"):
                raise ValueError(f"param group {g.get('name')!r}: kind must be 'muon' or 'adamw'")
        defaults = {"lr": lr, "momentum": momentum, "nesterov": nesterov, "betas": betas, "eps": eps,
                        "weight_decay": weight_decay, "block_axis": None, "block_size": None}
        super().__init__(groups, defaults)
        if capturable and any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            raise ValueError("capturable=True needs unsharded parameters (an FSDP2 Muon step gathers its updates)")
        # an attribute, not a group key: load_state_dict replaces groups, and the mode is this run's
        self.capturable = capturable
        # State exists for every parameter from the start (also one that never gets a gradient,
        # like layer 0's AttnRes query), so every checkpoint holds the same complete set.
        for group in self.param_groups:
            for p in group["params"]:
                if group["kind"] == "muon":
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                else:
                    step = torch.tensor(0.0, device=p.device if capturable else "cpu")
                    self.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        # the lr tensors a captured graph reads: kept by identity across load_state_dict
        self._lr_tensors = [self._lr_tensor(g) for g in self.param_groups] if capturable else []
        for g, lr_t in zip(self.param_groups, self._lr_tensors):
            # the peak as given, for a schedule to scale on the host (the fp32 tensor rounds it)
            g.setdefault("initial_lr", float(g["lr"]))
            g["lr"] = lr_t
        self.register_state_dict_post_hook(_float_lrs)
        self.register_load_state_dict_post_hook(_restore_mode)

    @staticmethod
    def _lr_tensor(group: dict) -> torch.Tensor:
        device = group["params"][0].device if group["params"] else "cpu"
        return torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        blocks = Blocks(group["block_axis"], group["block_size"])
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        # one launch per group on CUDA; on CPU the same per-tensor lerp_ as before
        torch._foreach_lerp_(bufs, grads, 1 - mom)
        updates = torch._foreach_lerp(grads, bufs, mom) if group["nesterov"] else bufs
        by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p, update in zip(params, updates):
            # a sharded DTensor (FSDP2) is orthogonalized whole: gather it first
            full = update.full_tensor() if isinstance(update, DTensor) else update
            by_shape.setdefault(tuple(full.shape), []).append((p, full))
        if self.capturable and wd:
            torch._foreach_mul_(params, 1 - lr * wd)  # lr a device tensor: decay of all at once
        # weights of one shape (e.g. all experts) share one batched Newton-Schulz
        for items in by_shape.values():
            updates = orthogonalize(torch.stack([u for _, u in items]), blocks)
            if self.capturable:
                updates.mul_(-lr)
                torch._foreach_add_([p for p, _ in items], list(updates.unbind(0)))
                continue
            for (p, _), u in zip(items, updates):
                if isinstance(p, DTensor):
                    # every rank holds the same full update: each keeps its own shard, no scatter
                    u = distribute_tensor(u, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * wd)
                p.add_(u, alpha=-lr)

    def _adamw(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr, capturable, foreach = group["lr"], False, False
        if self.capturable:
            # torch's capturable AdamW (tensor lr, device steps, no reads) runs on the devices it
            # lists (CUDA); elsewhere, as on CPU, a host read of lr costs no sync
            capturable = params[0].device.type in torch_adam._get_capturable_supported_devices()
            foreach = capturable and params[0].is_cuda
            lr = lr if capturable else float(lr)
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, capturable=capturable,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)


def _float_lrs(optimizer: PerHeadMuon, state_dict: dict) -> dict:
    """State dicts hold float lrs in both modes (JSON-able, and resumable into either mode)."""
    for g in state_dict["param_groups"]:
        for key in ("lr", "initial_lr"):
            if isinstance(g.get(key), torch.Tensor):
                g[key] = float(g[key])
    return state_dict


def _restore_mode(optimizer: PerHeadMuon) -> None:
    """After load_state_dict: the loaded lrs go into this run's lr tensors (same objects, so a
    captured graph still reads them) and the AdamW steps to where this mode keeps them."""
    for group, lr_t in zip(optimizer.param_groups, optimizer._lr_tensors):
        lr_t.fill_(float(group["lr"]))
        group["lr"] = lr_t
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state[p].get("step")
            if step is not None:
                where = p.device if optimizer.capturable else torch.device("cpu")
                optimizer.state[p]["step"] = step.to(device=where, dtype=torch.float32)
