"""Token sampling's one home: the primitives every sampler draws with and the bounds every verb checks.

`sample_next` picks a token per row of logits (greedy below `GREEDY_BELOW`, else temperature, top-k,
top-p); `sampling_probs` is the distribution it draws from. The reference generator
(k3/generation/generate.py), the serving sampler (k3/serve/sampling.py), speculative verification
(k3/serve/speculative_sampling.py, k3/serve/speculator.py) and RL rollouts all use these, so greedy
serving is the reference's own decoding by construction. `check_sampling` is the one range check of
temperature, top_p and top_k (`SamplingParams`, `k3 generate`; the API's schema declares the same
bounds from these constants).
"""
from __future__ import annotations

import torch

# the smallest normal fp32 number: below it a temperature is (or rounds to) zero in fp32
GREEDY_BELOW = torch.finfo(torch.float32).tiny
MAX_TEMPERATURE = 2.0  # the OpenAI API's bound; every verb that samples takes the same range


def check_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> None:
    """Raise ValueError naming the first parameter out of its range: temperature in
    [0, MAX_TEMPERATURE] (0 = greedy), top_p in (0, 1], top_k >= 0 (0 = off). NaN is out of range.
    Every value that passes is numerically safe for `sample_next`."""
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]. temperature 0 = greedy; top-k then top-p (nucleus) filtering.

    Safe for every temperature in [0, 2] and top_p in (0, 1]: a temperature too small to divide by
    in fp32 is greedy, logits are shifted by their row maximum before the division (so a tiny
    temperature gives -inf, never inf - inf = NaN), and top-p always keeps the top token (a top_p
    that rounds to 0 in fp32 would otherwise drop every token). Only non-finite logits can still
    make `torch.multinomial` raise.
    """
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sampling_probs(logits: torch.Tensor, *, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """logits [N, V] -> the distribution `sample_next` draws from [N, V] (fp32; temperature > 0):
    speculative decoding's rejection rule needs it whole, for the target and for the draft."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays
        drop = probs.cumsum(-1) - probs >= top_p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)
