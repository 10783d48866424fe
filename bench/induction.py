"""Steps until a model copies in context (induction), on pure synthetic data, beside a plain
transformer as the calibration (docs/LOG.md "RL and distillation": the post-training and vision
quality bars all wait on this).

    python -m bench.induction [--model k3|gpt-rope|gpt-nope|gpt-mla] [--steps 400] [--lr LR]
                              [--config k3-tiny] [--override '{"initializer_range": 0.05}']
                              [--optimizer per-head-muon|muon|adamw] [--clip 1.0] [--device cuda]
                              [--torch-init mla|all] [--mla-std 0.02] [--weight-init zero-out|normal]

Each row of a batch is 4 segments of 16 random tokens (ids 100-899), each shown twice; the
held-out batch's loss on the second showing (after its first token) against the first showing
is printed every 25 steps. No copying: both sit at ln 800 = 6.68 nats. Copying: the second
showing falls towards 0. Training is next-token loss on every position, batch 16 x 129 tokens,
warmup then cosine (k3: `k3 train`'s optimizer and schedule; gpt: AdamW, constant after a
20-step warmup). The GPTs are 2-layer pre-norm transformers, width 128, 4 heads, with or without
rotary positions: the smallest model known to grow an induction head, with and without
positional information in attention (K3's MLA has none: DESIGN §4). `gpt-mla` is the rotary GPT
with k3's GatedMLA (the `--config`'s dims, its decoupled RoPE on) in place of each attention:
K3's attention alone in a frame known to copy, drawn with torch's default init or, with
`--mla-std`, as K3 draws it (one normal std for every matrix).
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.mla import GatedMLA
from k3.threads import configure
from k3.train.init import INITS, init_for_training

SEGMENTS, SEGMENT, BATCH, FIRST_ID, IDS = 4, 16, 16, 100, 800


def batch(gen: torch.Generator):
    """(inputs [B, T], targets [B, T], second-showing mask [B, T]) for one batch."""
    segs = torch.randint(FIRST_ID, FIRST_ID + IDS, (BATCH, SEGMENTS, SEGMENT), generator=gen)
    x = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), torch.stack([segs, segs], 2).reshape(BATCH, -1)], 1)
    second = torch.zeros(BATCH, SEGMENTS, 2, SEGMENT, dtype=torch.bool)
    second[:, :, 1, 1:] = True  # the first token of a repeat cannot be predicted
    return x[:, :-1], x[:, 1:], second.reshape(BATCH, -1)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, rope: bool, mla: nn.Module | None = None):
        super().__init__()
        self.heads, self.rope, self.mla = heads, rope, mla
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        if mla is None:
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        t, hd = x.shape[-2], x.shape[-1]
        angle = torch.arange(t, device=x.device)[:, None] * 10000 ** (-torch.arange(0, hd, 2, device=x.device) / hd)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1).flatten(-2)

    def forward(self, x):
        if self.mla is not None:
            x = x + self.mla(self.n1(x))
            return x + self.mlp(self.n2(x))
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = self._rotate(q), self._rotate(k)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, rope: bool, d: int = 128, heads: int = 4, layers: int = 2, mla_config=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads, rope, None if mla_config is None else GatedMLA(mla_config, i))
                                    for i in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mla_linears(model: nn.Module):
    """Every Linear inside the model's GatedMLA layers, in registration order."""
    for mla in (m for m in model.modules() if isinstance(m, GatedMLA)):
        yield from (m for m in mla.modules() if isinstance(m, nn.Linear))


def k3_config(args, **defaults):
    """The `--config` preset or file with `defaults`, then the `--override` fields, set."""
    from k3.config import load_config
    config = load_config(args.config)
    for key, value in {**defaults, **json.loads(args.override)}.items():
        setattr(config, key, value)
    return config


def build(args):
    """(model, logits(ids [B, T]) -> [B, T, V], step(loss) -> None)."""
    if args.model == "k3":
        from k3.model.transformer import K3ForCausalLM
        from k3.train.balance import balance_step
        from k3.train.muon import PerHeadMuon, param_groups
        from k3.train.schedule import warmup_cosine

        config = k3_config(args)
        model = K3ForCausalLM(config)
        if args.torch_init:  # torch's fan-in-scaled Linear init in place of K3's one std for all
            linears = mla_linears(model) if args.torch_init == "mla" else (
                m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.endswith("_res_proj"))
            for module in linears:
                module.reset_parameters()
        init_for_training(model, args.weight_init)
        model.to(args.device)
        groups = param_groups(model, config, weight_decay=0.1, optimizer=args.optimizer)
        opt = PerHeadMuon(groups, lr=args.lr or 4e-3, weight_decay=0.1)
        schedule = warmup_cosine(opt, args.steps, 0.1)
        t = BATCH * (2 * SEGMENTS * SEGMENT)
        cu = torch.arange(0, t + 1, 2 * SEGMENTS * SEGMENT, dtype=torch.int32, device=args.device)

        def logits(ids):  # the rows packed as documents (cu_seqlens), as `k3 train` feeds them
            return model(ids.reshape(1, -1), cu_seqlens=cu)[0].view(*ids.shape, -1)

        def step(loss):
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            balance_step(model, "quantile")
        return model, logits, step
    mla_config = None
    if args.model == "gpt-mla":
        mla_config = k3_config(args, mla_use_nope=False)  # the GPT has no other source of position
    model = PlainGPT(FIRST_ID + IDS, rope=args.model == "gpt-rope", mla_config=mla_config)
    if args.mla_std:
        for module in mla_linears(model):
            nn.init.normal_(module.weight, 0.0, args.mla_std)
    model.to(args.device)
    lr = args.lr or 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    done = [0]

    def step(loss):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (done[0] + 1) / 20)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done[0] += 1
    return model, model, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("k3", "gpt-rope", "gpt-nope", "gpt-mla"), default="k3")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=None, help="default: k3 train's 4e-3 (k3), 1e-3 (gpt)")
    ap.add_argument("--config", default="k3-tiny")
    ap.add_argument("--override", default="{}", help="K3Config fields as JSON (k3 and gpt-mla)")
    ap.add_argument("--optimizer", default="per-head-muon", help="k3 only: per-head-muon | muon | adamw")
    ap.add_argument("--clip", type=float, default=1.0, help="k3 only: gradient norm clip (k3 train's), 0 = none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torch-init", choices=("mla", "all"), default=None,
                    help="k3 only: torch's default Linear init for the MLA projections or every Linear")
    ap.add_argument("--mla-std", type=float, default=None,
                    help="gpt-mla only: every MLA matrix drawn N(0, std), K3's init (default: torch's)")
    ap.add_argument("--weight-init", choices=INITS, default=None,
                    help=f"k3 only: how the model starts, as `k3 train --weight-init` (default {INITS[0]})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.torch_init and args.model != "k3":
        ap.error("--torch-init applies to --model k3 (the GPTs already use torch's init)")
    if args.weight_init is not None and args.model != "k3":
        ap.error("--weight-init applies to --model k3")
    args.weight_init = args.weight_init or INITS[0]
    if args.mla_std is not None and args.model != "gpt-mla":
        ap.error("--mla-std applies to --model gpt-mla")
    print(configure(args.threads).describe())
    torch.manual_seed(args.seed)
    model, logits, step = build(args)
    train_gen = torch.Generator().manual_seed(args.seed + 1)
    held_out = [t.to(args.device) for t in batch(torch.Generator().manual_seed(999))]
    print(f"{args.model}: no copying = ln {IDS} = {math.log(IDS):.2f} nats on both showings")
    t0, first_copy = time.perf_counter(), None
    for s in range(args.steps + 1):
        if s % 25 == 0:
            model.eval()
            with torch.no_grad():
                ids, targets, second = held_out
                nll = F.cross_entropy(logits(ids).float().transpose(1, 2), targets, reduction="none")
            model.train()
            a, b = float(nll[~second].mean()), float(nll[second].mean())
            if first_copy is None and b < 0.5 * a:
                first_copy = s
            print(f"step {s:5d}  first showing {a:.3f}  second showing {b:.3f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        if s == args.steps:
            break
        ids, targets, _ = (t.to(args.device) for t in batch(train_gen))
        step(F.cross_entropy(logits(ids).float().transpose(1, 2), targets))
    print(f"copies (second showing under half the first) from step {first_copy}" if first_copy is not None
          else f"no copying within {args.steps} steps")


if __name__ == "__main__":
    main()
