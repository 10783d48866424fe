"""What the GPU tests (`-m gpu`) share: the project's bars, unit-scale weights, the whole model the
model-level checks run, and its fp32 reference of bf16-rounded weights. Everything here also runs
on the CPU: the references are computed there."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from k3.config import K3Config, load_config
from k3.model.transformer import K3ForCausalLM
from tests.helpers import rel_err

FP32_TOL = 1e-4  # fp32 paths against their fp32 reference (RMSE ratio), outputs and gradients alike
BF16_TOL = 1e-2  # bf16 paths against the fp32 reference on the same bf16-rounded values
EXACT = 1e-6  # what must not move at all (causality, graph replay = eager)


@pytest.fixture
def side_stream():
    """Run the test on one CUDA stream that is not the legacy default one, so warm-up, eager
    backward passes and a capture all see the same stream (bench.common.graphed says why)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream().wait_stream(stream)


def gpu_config() -> K3Config:
    """k3-1b (D 1024, 8 KDA heads of 128): the tests then compile the Triton specializations
    (H 8, K 128) that the benches reuse, not ones nothing else runs."""
    return load_config("k3-1b")


@torch.no_grad()
def unit_scale_(module: nn.Module) -> nn.Module:
    """Unit-scale random weights. The 0.02 init leaves attention nearly uniform and outputs tiny,
    which would hide indexing and masking errors: every matrix ~ N(0, 1/fan_in) (fan_in is the
    last dim for Linear, Conv1d and the stacked experts), embeddings N(0, 1), norm weights
    U(0.5, 1.5), KDA decay parameters U(-1, 1); AttnRes pseudo-queries become non-zero too."""
    for name, p in module.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.normal_()
        elif p.dim() >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        elif name.endswith(("A_log", "dt_bias")):
            p.uniform_(-1.0, 1.0)
        else:
            p.uniform_(0.5, 1.5)
    return module


def dense_routing_model(seed: int = 0) -> K3ForCausalLM:
    """k3-tiny's structure (8 layers, 3:1 KDA:MLA, AttnRes blocks, latent MoE) with k3-1b's KDA heads,
    at its own init, every token routed to every expert. Whole-model comparisons are
    ill-conditioned otherwise: with top-k routing, bf16 rounding flips near-tied expert choices (a
    discrete jump per flipped token: 7% logits error at k=2 against 1% at k=E on CPU), and
    unit-scale weights make 8 layers chaotic (1e-3 input noise moved the logits 2..13%). The routed
    path itself is checked exactly in tests/model/test_gpu_moe.py."""
    cfg = load_config("k3-tiny").replace(hidden_size=256, kda_num_heads=8, kda_head_dim=128)
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg.replace(num_experts_per_token=cfg.num_experts)).eval()


def bf16_reference(model: K3ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fp32 logits on CPU of the model with its weights rounded to bf16 (what a bf16 model holds;
    the rounding itself is not the fast path's error), and how far the CPU torch path's own bf16
    forward is from them: what bf16 arithmetic costs this model, whatever the device. Eight layers
    of bf16 activations lose ~1.2e-2, more than one op's 1e-2, so whole-model bf16 comparisons are
    bounded by `model_bound` of that floor rather than by the per-op bar."""
    bf16 = copy.deepcopy(model).cpu().to(torch.bfloat16)
    with torch.no_grad():
        reference = copy.deepcopy(bf16).float()(ids.cpu())
        floor = rel_err(reference, bf16(ids.cpu()))
    return reference, floor


def model_bound(floor: float) -> float:
    """A bf16 device path may lose at most a quarter more than the CPU torch path's own bf16 forward."""
    return max(BF16_TOL, 1.25 * floor)
