"""What an ablation records about one finished run, beyond its final validation bits per byte.

- val_bpb_4x: held-out bits per byte on windows 4x the training length (the same tokens, fewer
  windows): how a mixer layout extrapolates in length (NoPE MLA, KDA's recurrent state, DESIGN §3-4).
- max_act: the largest |GLU output| over the held-out windows, over every FFN (dense, shared and
  routed experts): what SiTU-GLU bounds (DESIGN §6).
- loss_spikes: training steps whose loss exceeds SPIKE_RATIO x the median of the previous SPIKE_WINDOW.
- load_mean / load_final: the max/mean expert load (the worst MoE layer, as the trainer records it)
  averaged over all steps / over the last 10% of steps.
- val_bpb_mxfp4: held-out bits per byte after rounding the routed experts' weights to MXFP4 (the
  checkpoint format's rule, k3/quant/targets.py), activations untouched: post-training quantization.
  Last, because it overwrites the weights in memory (the run's checkpoints are already written).
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from k3.model.experts import RoutedExperts
from k3.quant.mx import fake_quantize
from k3.quant.targets import WEIGHT_FORMAT, WEIGHT_RULE

SPIKE_WINDOW = 10
SPIKE_RATIO = 1.1
LONG_FACTOR = 4


def loss_spikes(losses: list[float]) -> int:
    return sum(1 for t in range(SPIKE_WINDOW, len(losses))
               if losses[t] > SPIKE_RATIO * statistics.median(losses[t - SPIKE_WINDOW:t]))


def from_records(records: list[dict]) -> dict:
    """Figures read off metrics.jsonl's train records."""
    train = [r for r in records if r["kind"] == "train"]
    losses = [r["loss"] for r in train]
    loads = [r["max_load"] for r in train if r.get("max_load")]
    tail = max(1, len(train) // 10)
    return {"loss_spikes": loss_spikes(losses),
            "train_loss_final": statistics.fmean(losses[-tail:]) if losses else None,
            "load_mean": statistics.fmean(loads) if loads else None,
            "load_final": statistics.fmean(loads[-tail:]) if loads else None}


def _glu_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The expert banks and the dense / shared-expert FFNs: every module that applies a GLU `act`."""
    return [m for m in model.modules()
            if isinstance(m, RoutedExperts) or (hasattr(m, "down_proj") and callable(getattr(m, "act", None)))]


@torch.no_grad()
def max_activation(trainer) -> float:
    """The largest |GLU output| over one pass over the held-out windows."""
    peak = torch.zeros(())
    modules = _glu_modules(trainer.model)
    originals = [m.act for m in modules]

    def recording(act):
        def wrapped(gate, up):
            out = act(gate, up)
            peak.copy_(torch.maximum(peak, out.detach().abs().max().float().cpu()))
            return out
        return wrapped
    try:
        for m, act in zip(modules, originals):
            m.act = recording(act)
        trainer.evaluate()
    finally:
        for m, act in zip(modules, originals):
            m.act = act
    return float(peak)


def long_context_bpb(trainer) -> float | None:
    """Val bpb on windows LONG_FACTOR x the training length, the same number of tokens."""
    s = trainer.s
    T = s.seq_len * LONG_FACTOR
    if T > trainer.config.max_position_embeddings or trainer.val_data.num_windows(T, partial=True) < 1:
        return None
    windows = None if s.eval_windows is None else max(1, s.eval_windows // LONG_FACTOR)
    trainer.s = dataclasses.replace(s, seq_len=T, eval_windows=windows)
    try:
        return trainer.evaluate()["val_bpb"]
    finally:
        trainer.s = s


@torch.no_grad()
def mxfp4_bpb(trainer) -> float | None:
    """Val bpb with the routed experts' weights rounded to MXFP4 in place (None: no expert bank, or
    widths that MX blocks of 32 do not divide)."""
    banks = [m for m in trainer.model.modules() if isinstance(m, RoutedExperts)]
    if not banks:
        return None
    try:
        for bank in banks:
            for w in (bank.w1, bank.w3, bank.w2):
                w.copy_(fake_quantize(w, WEIGHT_FORMAT, WEIGHT_RULE))
    except ValueError:
        return None
    return trainer.evaluate()["val_bpb"]


def measure(trainer, final: dict) -> dict:
    """Everything an ablation table may show, from a trainer that has finished `train()`."""
    out = {"val_bpb": final["val_bpb"], "val_loss": final["val_loss"], "val_tokens": final["val_tokens"],
           "tokens": trainer.tokens_seen, "elapsed": trainer.elapsed, "params": trainer.params["total"],
           "active_params": trainer.params["active"], "lr": trainer.s.lr}
    out.update(from_records(trainer.metrics.read()))
    out["max_act"] = max_activation(trainer)
    out["val_bpb_4x"] = long_context_bpb(trainer)
    out["val_bpb_mxfp4"] = mxfp4_bpb(trainer)
    return out
