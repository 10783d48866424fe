"""Learning-rate schedule (DESIGN §8): linear warmup over 1% of the steps, then cosine decay to
`min_ratio` of the peak, as a torch LambdaLR (its state is a step counter, saved with checkpoints).
With a capturable optimizer (tensor lrs) LambdaLR fill_s each lr tensor in place; the schedule's
values themselves stay host floats, so a step neither reads the device nor logs a tensor."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

WARMUP_FRACTION = 0.01


@dataclass(frozen=True)
class WarmupCosine:
    """lr multiplier of optimizer step `step` (0-based). A dataclass, not a closure, so LambdaLR's
    state_dict records its fields and a checkpoint shows the schedule it ran with."""
    total_steps: int
    warmup_steps: int
    min_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class FloatLambdaLR(LambdaLR):
    """LambdaLR whose `get_last_lr()` is floats also when the groups' lrs are device tensors: the
    values the schedule computed on the host, not copies read back from the device."""

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._last_lr = [base_lr * lmbda(self.last_epoch) for lmbda, base_lr in zip(self.lr_lambdas, self.base_lrs)]


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, min_ratio: float = 0.1) -> LambdaLR:
    if total_steps < 1:
        raise ValueError(f"total steps must be >= 1, got {total_steps}")
    warmup = max(1, round(WARMUP_FRACTION * total_steps))
    for group in optimizer.param_groups:
        # a float peak: LambdaLR would otherwise keep a tensor copy and read it back every step
        if isinstance(group["lr"], torch.Tensor):
            group.setdefault("initial_lr", float(group["lr"]))
    return FloatLambdaLR(optimizer, WarmupCosine(total_steps, warmup, min_ratio))
