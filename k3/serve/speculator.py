"""The draft side of speculative decoding (DESIGN §11, §12.5): each running sequence's draft state,
proposing k tokens, and advancing the draft over the tokens the target verified.

Per sequence the draft keeps its KDA state (conv tails + recurrent state, `k3.model.draft`) after
the pairs (target representation at position t, token t+1) it has consumed, and the fused target
representation of the last computed position (`pending`), which pairs with the next token. Both
advance only over tokens the target computed and kept (prefill chunks, accepted drafts), so a
rejected draft never needs undoing here: proposing runs on a copy of the state.

Where the target skipped positions (a prefix-cache hit) the draft has no representations for
them and starts from a zero state at the hit: proposals may be weaker there, outputs are the same
(verification decides every token). A preempted sequence starts again with its recompute.
With a vision model the draft pairs a representation with the next position's input embedding as
the target read it: an image row over a placeholder, not the placeholder id's embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.cache import KDAState
from k3.model.draft import EagleDraft, depth_features
from k3.sampling import sampling_probs
from k3.serve.sampling import SamplingParams


@dataclass
class _DraftSeq:
    conv: torch.Tensor  # [3C, W-1]
    recurrent: torch.Tensor  # [H, K, V] fp32
    pending: torch.Tensor | None  # [D]: the fused representation of the last computed position


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] the distributions the tokens were drawn from (None: greedy)


class Speculator:
    def __init__(self, target, draft: EagleDraft, num_speculative_tokens: int):
        self.target, self.draft, self.k = target, draft.eval(), num_speculative_tokens
        self._seqs: dict[str, _DraftSeq] = {}

    def state_bytes(self) -> int:
        """What the draft keeps per running sequence (its state and one representation)."""
        s = self.draft.new_state(1)
        dtype_bytes = next(self.draft.parameters()).element_size()
        return (s.conv.numel() * dtype_bytes + s.recurrent.numel() * 4
                + self.draft.config.hidden_size * dtype_bytes)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)

    def can_propose(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        return seq is not None and seq.pending is not None

    def _states(self, rids: list[str]) -> KDAState:
        seqs = [self._seqs[r] for r in rids]
        return KDAState(torch.stack([s.conv for s in seqs]), torch.stack([s.recurrent for s in seqs]))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(ids)

    @torch.inference_mode()
    def propose(self, rids: list[str], last_tokens: list[int], counts: list[int], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[Proposal]:
        """counts[n] tokens after last_tokens[n] for each sequence, drawn as the request samples
        (argmax when greedy, else from the draft's distribution under its temperature / top-k /
        top-p), one batched draft step per token on a copy of the draft states."""
        device = next(self.draft.parameters()).device
        state = self._states(rids)  # stacked: a copy, the kept states are not advanced
        feature = torch.stack([self._seqs[r].pending for r in rids])[:, None]  # [N, 1, D]
        tokens = torch.tensor(last_tokens, device=device)
        drawn: list[list[int]] = [[] for _ in rids]
        probs: list[list[torch.Tensor]] = [[] for _ in rids]
        for step in range(max(counts)):
            feature = self.draft(feature, self._embed(tokens)[:, None], state=state)
            logits = self.target.lm_head(feature[:, 0]).float()
            picks = logits.argmax(-1).tolist()
            for n, p in enumerate(params):
                if step >= counts[n] or p.greedy:
                    continue
                law = sampling_probs(logits[n:n + 1].cpu(), temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
                picks[n] = int(torch.multinomial(law[0], 1, generator=generators[n]))
                probs[n].append(law[0])
            for n in range(len(rids)):
                if step < counts[n]:
                    drawn[n].append(picks[n])
            tokens = torch.tensor(picks, device=device)
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drawn, probs)]

    @torch.inference_mode()
    def advance(self, rids: list[str], tokens: list[list[int]], hidden_out: list[torch.Tensor],
                positions: list[list[int]], inputs: torch.Tensor | None = None) -> None:
        """The target computed tokens[n] of sequence rids[n] at rows positions[n] of the packed
        step (its hidden_out list); consume the pairs (representation, next token) they complete.
        `inputs` [T, D]: the step's input embeddings when they are not the tokens' (a vision
        model's image rows over their placeholders): the draft reads what the target read."""
        fused = self.draft.fuse(depth_features([h[0] for h in hidden_out]))  # [T, D]
        device = fused.device
        feats, embeds, lengths, active = [], [], [], []
        for rid, toks, rows in zip(rids, tokens, positions):
            seq = self._seqs.get(rid)
            if seq is None:
                s = self.draft.new_state(1, device, fused.dtype)
                seq = self._seqs[rid] = _DraftSeq(s.conv[0], s.recurrent[0], None)
            # pairs: (pending, tok 0), (f 0, tok 1), ..., (f m-2, tok m-1); then pending = f m-1
            rows_t = torch.tensor(rows, device=device)
            pair_feats, pair_rows = fused[rows_t[:-1]], rows_t[1:]
            if seq.pending is not None:
                pair_feats, pair_rows = torch.cat([seq.pending[None], pair_feats]), rows_t
            seq.pending = fused[rows_t[-1]]
            if len(pair_rows):
                feats.append(pair_feats)
                embeds.append(self._embed(torch.tensor(toks[-len(pair_rows):], device=device)) if inputs is None
                              else inputs[pair_rows].to(pair_feats.dtype))
                lengths.append(len(pair_rows))
                active.append(rid)
        if not active:
            return
        state = self._states(active)
        cu = torch.tensor([0] + lengths, device=device).cumsum(0)
        self.draft(torch.cat(feats)[None], torch.cat(embeds)[None], cu_seqlens=cu, state=state)
        for n, rid in enumerate(active):
            self._seqs[rid].conv, self._seqs[rid].recurrent = state.conv[n], state.recurrent[n]
