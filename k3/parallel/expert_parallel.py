"""Expert parallelism: routed experts sharded over an EP group, tokens moved by all-to-all (DESIGN §14.2).

N tokens on this rank, k experts per token, E experts, R EP ranks (E % R == 0, E/R home experts
each), H expert width, G guest slots (copies of other ranks' experts for this micro-batch).

Per MoE layer and micro-batch, on every rank of the EP group:
  1. the per-expert pair counts of every rank are all-gathered ([R, E] ints; small);
  2. a placement is planned from them, the same on every rank (k3/parallel/ep_plan.py): "balanced"
     = MoonEP's online plan, exactly N*k pairs per rank with at most E/R guests; "home" = plain EP;
  3. the guests' weights are fetched from their home ranks (one all-to-all of [G, ...] rows; its
     backward sends their gradients home and sums them there);
  4. the pairs are dispatched with one all_to_all_single (variable splits), the local grouped GEMM
     (RoutedExperts.run_sorted) runs on home + guest experts, and a second all_to_all_single
     returns the results, which are weighted and summed per token as on one device.
Under "balanced" the receive buffer is always [N*k, H] (every rank receives what it sends), the
static shape MoonEP's kernels rely on; torch's all_to_all_single still takes its split sizes on
the host, so the counts are read back once per layer (a fused dispatch kernel would not need it).

Expert weights are DTensors sharded on dim 0 over the mesh's "ep" dimension and FSDP2-sharded over
"dp" (k3/train/parallel.py), so full-state-dict checkpoints are layout free. Gradients: the
all-to-all backward brings every pair's gradient to the rank that ran it, so an expert's gradient
on its EP rank sums its whole EP group's tokens; scaled by 1/EP and averaged over "dp" by FSDP it
matches the dense weights' average over all ranks (a custom FSDP divide factor would need
PREMUL_SUM, which gloo lacks).
No model code changes: the bank's forward is replaced on the instance from outside.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from k3.model.experts import RoutedExperts, expert_counts
from k3.parallel.ep_plan import Placement, home_ranks, plan_balanced, plan_static, route_rank

PLANS = ("home", "balanced")


class _AllToAll(torch.autograd.Function):
    """Rows of x [M, ...] split by in_splits go to the ranks in order; returns the rows received
    (out_splits from each rank). Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallel:
    """Runs every RoutedExperts bank of a model over an EP process group.

    `plan`: "balanced" (MoonEP online placement with guest copies) or "home" (plain EP).
    `grad_scale` multiplies the experts' weight gradients (1/EP under FSDP: an expert's gradient
    already sums its EP group's tokens, and FSDP then averages it over the DP ranks only).
    `last_placement` keeps the latest layer's plan (for tests and logging)."""

    def __init__(self, group=None, plan: str = "balanced", grad_scale: float = 1.0):
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        self.group, self.plan, self.grad_scale = group, plan, grad_scale
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.last_placement: Placement | None = None

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                if module.num_experts % self.world:
                    raise ValueError(f"expert parallelism needs num_experts ({module.num_experts}) divisible by "
                                     f"the EP size ({self.world})")
                if type(module) is not RoutedExperts:
                    raise ValueError(f"expert parallelism runs plain RoutedExperts, not {type(module).__name__} "
                                     "(e.g. QAT's quantized bank)")
                module.forward = types.MethodType(self._forward, module)
        return model

    def _local_weights(self, experts: RoutedExperts) -> tuple[torch.Tensor, ...]:
        """This rank's home experts' (w1, w3, w2), [E/R, ...] each."""
        out = []
        for w in (experts.w1, experts.w3, experts.w2):
            if isinstance(w, DTensor):
                w = w.to_local()
            elif w.shape[0] == experts.num_experts:  # not yet sharded (a single-process EP group)
                per = experts.num_experts // self.world
                w = w[self.rank * per:(self.rank + 1) * per]
            out.append(w if self.grad_scale == 1.0 else _ScaleGrad.apply(w, self.grad_scale))
        return tuple(out)

    def _forward(self, experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        R, me, E, group = self.world, self.rank, experts.num_experts, self.group
        n, k = idx.shape
        per = E // R
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, E)
        gathered = [torch.empty_like(counts) for _ in range(R)]
        dist.all_gather(gathered, counts, group=group)
        everyone = torch.stack(gathered).cpu()  # [R, E]: the plan's input, read on the host once
        load = everyone.sum(0)
        if self.plan == "balanced":
            placement = plan_balanced(load, R)
        else:
            placement = plan_static(load, R, home_ranks(E, R))
        self.last_placement = placement
        mine, recv_counts = route_rank(everyone, placement, me)  # [E, dst] I send, [src, E] I receive

        # 3. guest weights from their home ranks: rows of [w1 | w3 | w2] flattened, one per expert
        home_w = self._local_weights(experts)
        shapes = [w.shape[1:] for w in home_w]
        rows = torch.cat([w.flatten(1) for w in home_w], dim=1)  # [E/R, F]
        wanted = [[e for e in placement.guests[r] if placement.home[e] == me] for r in range(R)]  # mine, per guest rank
        out_rows = [len([e for e in placement.guests[me] if placement.home[e] == src]) for src in range(R)]
        send_rows = torch.cat([rows[[e - me * per for e in wanted[r]]] for r in range(R)]) if any(wanted) \
            else rows[:0]
        guests = list(placement.guests[me])  # sorted; received in (home rank, expert) order = sorted order
        guest_rows = all_to_all(send_rows, out_rows, [len(w) for w in wanted], group)
        local_experts = list(range(me * per, (me + 1) * per)) + guests
        all_rows = torch.cat([rows, guest_rows])  # used even when empty: every rank runs every backward all-to-all
        sizes = [s.numel() for s in shapes]
        w1, w3, w2 = (t.view(len(local_experts), *s) for t, s in zip(all_rows.split(sizes, dim=1), shapes))

        # 4. dispatch: my pairs sorted by expert, then cut per expert over its hosts in rank order
        dest = torch.repeat_interleave(torch.arange(R).repeat(E), mine.flatten())  # per sorted pair
        by_dest = torch.argsort(dest.to(flat.device), stable=True)  # (dst, expert) order
        pairs = order[by_dest]  # positions in the flat (token, slot) list
        in_splits = mine.sum(0).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = all_to_all(x.index_select(0, pairs // k), out_splits, in_splits, group)
        # received rows: by source, then expert; run them grouped by local slot
        recv_expert = torch.repeat_interleave(torch.arange(E).repeat(R), recv_counts.flatten())
        slot_of = torch.full((E,), -1, dtype=torch.long)
        slot_of[torch.tensor(local_experts, dtype=torch.long)] = torch.arange(len(local_experts))
        recv_slot = slot_of[recv_expert]
        by_slot = torch.argsort(recv_slot, stable=True).to(x.device)
        slot_counts = torch.bincount(recv_slot, minlength=len(local_experts)).to(x.device)
        y = experts.run_sorted(recv.index_select(0, by_slot), slot_counts, weights=(w1, w3, w2))
        y = torch.zeros_like(y).index_copy(0, by_slot, y)  # back to the received order
        back = all_to_all(y, in_splits, out_splits, group)  # [n*k, H] in (dst, expert) order
        # combine as RoutedExperts.forward does: weight each pair, sum a token's k slots in fp32
        back = back.float() * weights.flatten()[pairs, None]
        out = torch.zeros(n * k, back.shape[1], dtype=back.dtype, device=back.device).index_copy(0, pairs, back)
        return out.view(n, k, -1).sum(1).to(x.dtype)
