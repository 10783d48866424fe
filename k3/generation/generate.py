"""Simple batched generation on top of the model's cache: packed prefill, then one token per
sequence per step (no padding anywhere: sequences of different lengths are packed with cu_seqlens).
The serving engine (k3/serve) is the scalable path; this one is the readable reference it must
match token for token under greedy decoding. Tokens are picked by `k3.sampling.sample_next`, the
serving sampler's own primitive.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3.model.cache import K3Cache
from k3.quant.qat import reused_weight_quantization
from k3.sampling import sample_next


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id: int | Sequence[int] | None = None,
             seed: int | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Continue each prompt; returns the new tokens of each (stopping at eos, which is kept; several
    stop ids may be given, e.g. a chat reply ends at `<|end_of_msg|>` or at eos)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, each with at least one token")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    stops = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    with reused_weight_quantization(model):  # QAT experts: the weights quantized once, not at every token
        cache = K3Cache.empty(model.config, len(prompts), device=device, dtype=dtype)
        ids = torch.tensor([t for p in prompts for t in p], device=device)[None]
        cu = torch.tensor([0] + [len(p) for p in prompts], device=device).cumsum(0)
        logits = model(ids, cu_seqlens=cu, cache=cache, logits_to_keep=cu[1:] - 1)[0]  # last position of each prompt
        outputs: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))  # prompt index of each row of the cache
        for _ in range(max_new_tokens):
            tokens = sample_next(logits, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
            still = []
            for row, seq in enumerate(active):
                token = int(tokens[row])
                outputs[seq].append(token)
                if on_token is not None:
                    on_token(seq, token)
                if token not in stops and len(outputs[seq]) < max_new_tokens:
                    still.append(row)
            if not still:
                break
            if len(still) < len(active):
                cache = cache.select(still)
                tokens = tokens[still]
                active = [active[r] for r in still]
            step = torch.arange(len(active) + 1, device=device)
            logits = model(tokens[None], cu_seqlens=step, cache=cache)[0]
    return outputs
