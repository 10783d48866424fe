"""How a training run draws a model it starts from scratch.

K3's modules draw every matrix N(0, initializer_range), as transformers' `_init_weights` does; that
stays the model's own init (what `from_pretrained` gives a tensor the checkpoint lacks). A run from
scratch then sets, by default, each residual branch's last projection to zero, as nanochat's
`init_weights` does: every layer starts as the identity on the residual stream and each token's own
embedding reaches every layer undiluted. Under K3's one-std draw the six KDA layers of k3-tiny
each add an RMS-normalized output of ~5x the embedding's scale (DESIGN §3: o_norm before o_proj), and the
NoPE hybrid learned no in-context copying in 3,000 steps of pure copy data; from zero it copies
from 575-950 (docs/LOG.md "RL and distillation").
"""
from __future__ import annotations

import torch
from torch import nn

INITS = ("zero-out", "normal")  # the default first; "normal": K3's draw left as it is
# what each residual branch writes through last: the attention outputs (KDA and MLA), the dense and
# shared-expert down projections, the latent MoE's way back to the hidden width (DESIGN §6)
OUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")


@torch.no_grad()
def init_for_training(model: nn.Module, init: str) -> nn.Module:
    """`model` (just built) as a run from scratch starts it; text and vision-language models alike
    (the vision tower and projector keep their draw: their branches end in `wo` / `fc1`)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "zero-out":
        for name, p in model.named_parameters():
            if name.endswith(OUT_PROJECTIONS):
                p.zero_()
    return model
