"""Auto-throttled admission (K3 report §7.4): how many requests the scheduler lets in follows the
running requests, the queue and the page pool's use, instead of admitting until preemption thrashes.

The rule, checked for the head of the waiting queue each time the scheduler would admit it:

    used + sum over running r of grow(r) + need(head) <= target_usage * num_pages

- `used`: pages held now (a shared prefix page once; cached-but-free pages count as free);
- `grow(r)`: pages a running request still takes to reach its projected length,
  `tokens + ratio * (max_tokens - generated)`; `need(head)`: what admitting it takes now (state,
  pages past its prefix hit) plus its own projected growth;
- `ratio`, the share of the remaining output to reserve, adapts (SGLang's `new_token_ratio`): it
  starts at `output_ratio`, falls by `ratio_decay` each step without a preemption down to
  `min_output_ratio` (requests often stop early), and returns to 1 on a preemption (a request
  outgrew its reservation: reserve whole outputs until the pool has room again).
A request is always admitted when nothing runs (progress), and `max_num_seqs` stays a hard cap.
Short contexts project small, so many run at once; long ones project large, so fewer do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdmissionController:
    num_pages: int
    target_usage: float = 0.95
    output_ratio: float = 0.7
    min_output_ratio: float = 0.1
    ratio_decay: float = 0.001

    def __post_init__(self):
        if not 0 < self.target_usage <= 1:
            raise ValueError(f"admission target usage must be in (0, 1], got {self.target_usage}")
        if not 0 <= self.min_output_ratio <= self.output_ratio <= 1:
            raise ValueError("admission output ratios must satisfy 0 <= min <= initial <= 1, got "
                             f"{self.min_output_ratio} and {self.output_ratio}")
        if self.ratio_decay < 0:
            raise ValueError(f"admission ratio decay must be >= 0, got {self.ratio_decay}")
        self.ratio = self.output_ratio
        self.admitted = 0  # admissions, re-admissions after a preemption included
        self.deferred = 0  # steps whose queue head waited for room the rule kept

    def projected_tokens(self, num_tokens: int, remaining_output: int, max_model_len: int) -> int:
        """The length a request is expected to reach."""
        return min(num_tokens + math.ceil(self.ratio * max(remaining_output, 0)), max_model_len)

    def step(self, preempted: bool) -> None:
        """Adapt the reserved share of remaining outputs after a step's running requests grew."""
        self.ratio = 1.0 if preempted else max(self.min_output_ratio, self.ratio - self.ratio_decay)

    def admits(self, used: int, growth: int, need: int, num_running: int) -> bool:
        if num_running == 0 or used + growth + need <= self.target_usage * self.num_pages:
            return True
        self.deferred += 1
        return False
