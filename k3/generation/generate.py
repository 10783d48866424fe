"""Simple batched generation on top of the model's cache: packed prefill, then one token per
sequence per step (no padding anywhere: sequences of different lengths are packed with cu_seqlens).
The serving engine (k3/serve) is the scalable path; this one is the readable reference it must
match token for token under greedy decoding.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3.model.cache import K3Cache
from k3.quant.qat import reused_weight_quantization

# the smallest normal fp32 number: below it a temperature is (or rounds to) zero in fp32
GREEDY_BELOW = torch.finfo(torch.float32).tiny
MAX_TEMPERATURE = 2.0  # the OpenAI API's bound; every verb that samples takes the same range


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
