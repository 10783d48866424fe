"""Speculative decoding's verification rule: which drafted tokens a sequence keeps, and the one
token the target adds after them (Leviathan et al. 2023, Chen et al. 2023).

Given the target's logits at the sequence's last token and at each of its k drafted tokens
([k+1, V]: row i scores the token after draft i) and the drafts d_1..d_k:
- greedy (temperature 0): keep the longest prefix of drafts equal to the target's argmax, then the
  target's argmax after it. The output is the target's greedy output, token for token.
- sampling: draft d_i was drawn from q_i (the draft's distribution under the request's
  temperature / top-k / top-p); keep it with probability min(1, p_i(d_i) / q_i(d_i)), p_i the
  target's distribution under the same settings; at the first rejection draw from the residual
  norm(max(0, p_i - q_i)) and stop; if all k are kept, draw the bonus token from p_{k+1}. Every
  emitted token is then distributed exactly as the target alone would sample it.
Draws use the request's own generator (its seed), as plain sampling does.
"""
from __future__ import annotations

import torch

from k3.sampling import sampling_probs
from k3.serve.sampling import SampledToken, SamplingParams


def verify(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """-> the kept drafts and the target's next token (1 to k+1 tokens). target_logits [k+1, V];
    draft_probs [k, V] (fp32, the distributions the drafts were drawn from; None for greedy)."""
    k = len(drafts)
    if params.greedy:
        best = target_logits.argmax(-1).tolist()
        kept = 0
        while kept < k and drafts[kept] == best[kept]:
            kept += 1
        return drafts[:kept] + [best[kept]]
    p = sampling_probs(target_logits.float().cpu(), temperature=params.temperature, top_p=params.top_p,
                       top_k=params.top_k)
    q = draft_probs.cpu() if drafts else None  # no drafts (none proposed this step): plain sampling
    out = []
    for i, d in enumerate(drafts):
        if torch.rand((), generator=generator) * q[i, d] < p[i, d]:  # r < p/q without dividing by q
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        # p == q up to rounding: the residual is empty and p itself is the right law
        law = residual / total if total > 0 else p[i]
        return out + [int(torch.multinomial(law, 1, generator=generator))]
    return out + [int(torch.multinomial(p[k], 1, generator=generator))]


def with_logprobs(tokens: list[int], target_logits: torch.Tensor, params: SamplingParams) -> list[SampledToken]:
    """SampledTokens for tokens[i] scored by row i of target_logits (the raw distribution, as the
    API reports logprobs), with the top alternatives when asked."""
    if params.logprobs is None:
        return [SampledToken(t) for t in tokens]
    logprobs = torch.log_softmax(target_logits[:len(tokens)].float().cpu(), dim=-1)
    out = []
    for i, t in enumerate(tokens):
        s = SampledToken(t, float(logprobs[i, t]))
        if params.logprobs:
            top = torch.topk(logprobs[i], params.logprobs)
            s.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        out.append(s)
    return out
