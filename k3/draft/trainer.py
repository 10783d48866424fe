"""Training the EAGLE-3-style draft on the frozen target (DESIGN §12.5).

Per batch of target outputs x [B, T]: the target (no gradient) gives its distributions p and its
depth representations; the draft consumes the pairs (fused representation at t, token t+1) and
its output at pair t predicts token t+2 (target law p at position t+1). Training-time unrolling:
from anchor positions a the draft runs `unroll - 1` more steps, each fed its own previous output
in place of the target's representation (as at serving time, where the target has not run yet)
and the true next token; step j predicts token a+j+1 against p at a+j. Anchors are the ends of
segments of `anchor_every` pairs: the draft's KDA state is carried segment by segment, so the
state at each anchor is at hand without a state per position.

Loss: the LK loss -log sum_v min(p_v, q_v), the probability that speculative sampling accepts a
draft token (Leviathan et al.): maximizing it maximizes acceptance directly, averaged over the
unrolled steps.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from k3.model.cache import KDAState
from k3.model.draft import EagleDraft, depth_features


@dataclass
class DraftSettings:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128  # prompt + generated tokens per training sequence
    prompt_len: int = 16
    num_sequences: int = 768  # target outputs generated once, up front
    sampled_fraction: float = 0.5  # the rest are greedy continuations
    unroll: int = 7  # draft steps per anchor (DESIGN §12.5): 1 on the target's representation + 6 on its own
    anchor_every: int = 16  # pairs per training segment: unrolled chains start at each segment's end
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0


def lk_loss(p: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """-log sum_v min(p, q) per row ([..., V] -> [...]); p the target's law, q = softmax(draft)."""
    q = torch.softmax(draft_logits.float(), dim=-1)
    return -torch.minimum(p, q).sum(-1).clamp_min(1e-6).log()


class DraftTrainer:
    def __init__(self, target, draft: EagleDraft, settings: DraftSettings):
        self.target, self.draft, self.s = target.eval(), draft, settings
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=settings.lr,
                                           weight_decay=settings.weight_decay, betas=(0.9, 0.95))

    def lr_at(self, step: int) -> float:
        warmup = max(1, self.s.steps // 20)
        if step < warmup:
            return self.s.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.s.steps - warmup)
        return self.s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """x [B, T] -> (mean LK loss over steps, per-step mean LK loss)."""
        B, T = x.shape
        with torch.no_grad():
            hidden_out: list = []
            p = torch.softmax(self.target(x, hidden_out=hidden_out).float(), dim=-1)  # [B, T, V]
            features = depth_features(hidden_out)
            embeds = self.target.model.embed_tokens(x)
        fused = self.draft.fuse(features)
        head = self.target.lm_head
        # step 1: pairs t = 0..T-2, segment by segment, the state carried (and kept at each end)
        state = self.draft.new_state(B, x.device, fused.dtype)
        outs, anchors, anchor_states = [], [], []
        for s in range(0, T - 1, self.s.anchor_every):
            e = min(s + self.s.anchor_every, T - 1)
            outs.append(self.draft(fused[:, s:e], embeds[:, s + 1:e + 1], state=state))
            anchors.append(e - 1)
            anchor_states.append((state.conv, state.recurrent))
        out = torch.cat(outs, dim=1)  # [B, T-1, D]: pair t predicts token t+2
        per_step = [lk_loss(p[:, 1:], head(out)).mean()]
        # steps 2..unroll from each anchor a: input (previous output, token a+j), target p[a+j]
        a = torch.tensor(anchors, device=x.device)
        n = len(anchors)
        state = KDAState(torch.stack([c for c, _ in anchor_states], 1).flatten(0, 1),
                         torch.stack([r for _, r in anchor_states], 1).flatten(0, 1))  # [B*n, ...]
        feature = out[:, a].reshape(B * n, 1, -1)
        for j in range(2, self.s.unroll + 1):
            valid = a + j <= T - 1
            if not valid.any():
                break
            pos = (a + j).clamp(max=T - 1)
            token_emb = embeds[:, pos].reshape(B * n, 1, -1)
            feature = self.draft(feature, token_emb, state=state)
            loss = lk_loss(p[:, pos].reshape(B * n, -1), head(feature[:, 0]))
            mask = valid.repeat(B).float()
            per_step.append((loss * mask).sum() / mask.sum())
        total = torch.stack(per_step).mean()
        return total, [float(v.detach()) for v in per_step]

    def train(self, data: torch.Tensor, progress=None, log=print) -> list[dict]:
        """data [N, T] target outputs; returns the per-step records."""
        g = torch.Generator().manual_seed(self.s.seed)
        records, t0 = [], time.perf_counter()
        self.draft.train()
        for step in range(self.s.steps):
            batch = data[torch.randint(0, len(data), (self.s.batch_size,), generator=g)]
            lr = self.lr_at(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss, per_step = self.losses(batch.to(next(self.draft.parameters()).device))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
            self.optimizer.step()
            elapsed = time.perf_counter() - t0
            rec = {"step": step + 1, "loss": float(loss.detach()), "per_step": per_step, "lr": lr, "elapsed": elapsed,
                   "tok_per_s": int(batch.numel() * (step + 1) / max(elapsed, 1e-9))}
            records.append(rec)
            if progress is not None:
                progress.update(step + 1, rec)
        self.draft.eval()
        return records
