"""What several bench scripts share: the relative error every comparison reports, random KDA op
inputs shaped as the layer passes them, and a switch that forces the routed experts' loop.

B batch, T tokens, H heads, K key dim (= value dim here), N sequences.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from k3.model import experts as experts_module
from k3.ops.kda import DecayGate, kda


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMSE(ref - out) / RMSE(ref), in fp64 (the tests' measure, tests/helpers)."""
    ref, out = ref.detach().double(), out.detach().double()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@contextlib.contextmanager
def per_expert_loop() -> Iterator[None]:
    """Force RoutedExperts onto its per-expert loop, whatever the device and dtype."""
    saved = experts_module.grouped_mm_available
    experts_module.grouped_mm_available = lambda x: False
    try:
        yield
    finally:
        experts_module.grouped_mm_available = saved


def kda_gate_case(form: str, seed: int, B: int = 2, T: int = 1000, H: int = 8, K: int = 128,
                  device: str = "cuda"):
    """One seed's KDA op inputs with the gate still raw, as the layer hands them over: unit-norm
    q, k; v; raw gate projections [B, T, H, K]; sigmoid beta; a random initial state [B, H, K, K];
    A_log and dt_bias of the bounded gate ("lb", unit-scale) or the softplus gate ("softplus", at
    the official init). q, k, v and beta are rounded to bf16 once; returns (fp32 reference leaves,
    bf16 leaves for fla) in the order q, k, v, raw gate, beta, h0, A_log, dt_bias, every leaf
    requiring grad; the gate's lower bound; random loss weights do [B, T, H, K], ds [B, H, K, K]."""
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, K)
    beta = torch.sigmoid(torch.randn(B, T, H))
    h0 = torch.randn(B, H, K, K)
    raw = torch.randn(B, T, H, K)
    if form == "lb":
        A_log, dt_bias, lower_bound = torch.empty(H).uniform_(-1, 1), torch.empty(H * K).uniform_(-1, 1), -5.0
    else:
        dt = torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        A_log, dt_bias, lower_bound = torch.empty(H).uniform_(1, 16).log(), dt + torch.log(-torch.expm1(-dt)), None
    rounded = [t.to(device, torch.bfloat16) if i in (0, 1, 2, 4) else t.to(device)
               for i, t in enumerate((q, k, v, raw, beta, h0, A_log, dt_bias))]
    ref = [t.float().clone().requires_grad_() for t in rounded]
    out = [t.clone().requires_grad_() for t in rounded]
    do, ds = torch.randn(B, T, H, K, device=device), torch.randn(B, H, K, K, device=device)
    return ref, out, lower_bound, do, ds


def gated_kda_grads(impl: str, leaves: list[torch.Tensor], lower_bound: float | None, do, ds,
                    weights: tuple[float, float] = (1.0, 1.0)):
    """kda as the layer calls it (the gate activated by the op: in fla's kernels for impl "fla"),
    leaves as kda_gate_case makes them: o, the final state and the gradient of every leaf, of
    weights[0] * <o, do> + weights[1] * <state, ds>."""
    o, s = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, impl=impl,
               gate=DecayGate(*leaves[6:], lower_bound))
    loss = weights[0] * (o.float() * do).sum() + weights[1] * (s * ds).sum()
    return o, s, *torch.autograd.grad(loss, leaves)


def graphed(step):
    """`step()` captured as a CUDA graph after two eager runs (fla's autotuning, cuBLAS handles and
    the allocator warm off the capture); returns (graph, its static outputs). Warm-up and capture
    share one stream that is not the legacy default one: the current stream when it already is
    such a stream, else a new one. Autograd remembers the stream each leaf's gradient was first
    accumulated on; a backward captured on another stream makes that stream wait on the capture
    and fails it ("legacy stream depend on a capturing blocking stream"), so a caller whose leaves
    ran backward before runs everything on one side stream (tests.helpers.gpu.side_stream)."""
    current = torch.cuda.current_stream()
    stream = current if current != torch.cuda.default_stream() else torch.cuda.Stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = step()
    current.wait_stream(stream)
    return graph, outs


def random_tiny_run(folder, texts: list[str] | None = None):
    """A run folder laid out as `k3 train` writes it (pretraining: no chat template), with one
    checkpoint of k3-tiny's random weights (seed 0) over a 300-token tokenizer trained on `texts`."""
    from k3.checkpoint.official import save_pretrained
    from k3.config import load_config
    from k3.model.transformer import K3ForCausalLM
    from k3.text.tokenizer import save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(texts or ["The quick brown fox jumps over the lazy dog."] * 4, 300)
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size()))
    step = folder / "checkpoints" / "step_0000001"
    save_pretrained(model, step)
    save_tokenizer(tokenizer, step)
    return folder
