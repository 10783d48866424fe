"""Correctness of the GPU paths against fp32 torch references on random inputs (issue #5).

    python bench/gpu_checks.py [--smoke] [--only kda,layers,moe]

Every comparison is `rel = RMSE(ref - out) / RMSE(ref)` (tests/conftest.py) on fresh random inputs
(never zeros), against issue #5's bar: 1e-4 for fp32 paths, 1e-2 for bf16 ones, outputs and
gradients alike. Two composite checks, a whole KDA layer under bf16 autocast and a whole model in
bf16, lose more than 1e-2 on the CPU torch path itself (bf16 rounding through every projection in
series); there the bound is twice (layer) or 1.25x (model) that CPU figure, measured in the same
check, so the device path may not add to what bf16 costs. Each check prints name, rel, bound
and PASS / FAIL. fp32 models never reach fla's KDA kernels (k3.ops.kda sends fp32 to the torch
paths: Triton's fp32 `tl.dot` rounds operands to tf32), so every fp32 comparison is held to 1e-4.

Groups (each runs in its own process under bench/gpu_run.py, so a device-side assert in one
cannot take the others down):
- kda:    the KDA op as the layer calls it (raw gate projections, activated in fla's kernels;
          safe_gate for K3's bounded gate) vs k3's torch chunk reference: bf16 inputs, both gate
          forms, packed (cu_seqlens) with initial states, prefix invariance (fla issue #1240); fp32
          through "auto" (the torch chunk path on CUDA) vs the recurrent reference; the causal short
          conv, fla vs torch, packed with tails; the output norm-gate, fla vs torch.
- layers: KimiDeltaAttention on CUDA vs the same layer on CPU fp32; gated MLA bf16 naive and
          absorbed with a cache vs fp32; a whole k3-tiny-shaped model, bf16 CUDA logits vs fp32
          CPU, and decode = prefill on CUDA.
- moe:    routed experts through torch._grouped_mm (bf16, sm90) vs the per-expert loop, and the
          whole MoE layer under bf16 autocast with fp32 parameters (the training setting).
On a machine without CUDA or fla (--smoke), the same code runs on CPU at tiny sizes with the
recurrent reference standing in for fla, and fla-only checks are recorded as SKIP.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3.config import K3Config, load_config  # noqa: E402
from k3.model import experts as experts_module  # noqa: E402
from k3.model.cache import K3Cache, KDAState, MLAState  # noqa: E402
from k3.serve.decode_graph import CUDAGraphDecoder, capturable_experts  # noqa: E402
from k3.regional_compile import compile_regions  # noqa: E402
from k3.model.experts import RoutedExperts  # noqa: E402
from k3.model.kda import KimiDeltaAttention  # noqa: E402
from k3.model.mla import GatedMLA  # noqa: E402
from k3.model.moe import StableLatentMoE  # noqa: E402
from k3.model.transformer import K3ForCausalLM  # noqa: E402
from k3.ops import fla_kernels  # noqa: E402
from k3.ops.conv import causal_conv1d  # noqa: E402
from k3.ops.kda import DecayGate, kda  # noqa: E402
from k3.ops.norm_gate import rms_norm_gated  # noqa: E402
from tests.conftest import rel_err  # noqa: E402
from tests.test_kda_ops import make_gate, make_inputs  # noqa: E402

Record = Callable[[dict], None]

# Bounds (see the module docstring): issue #5's bar, forward and backward alike. Composite checks
# (a whole layer under bf16 autocast, a whole model) are bounded by what bf16 costs the CPU torch
# path itself on the same inputs, when that is more than the bar: the device path may not add to it.
FP32 = 1e-4
BF16 = 1e-2
EXACT = 1e-6  # causality: a prefix must not see the future at all


def gpu_config(smoke: bool) -> K3Config:
    """k3-1b (D=1024, 8 KDA heads of 128) on GPU: the checks then compile exactly the Triton
    specializations (H=8, K=128) that the benches reuse. k3-tiny for --smoke."""
    return load_config("k3-tiny" if smoke else "k3-1b")


def model_config(smoke: bool) -> K3Config:
    """k3-tiny's structure (8 layers, 3:1 KDA:MLA, AttnRes blocks, latent MoE) with the KDA heads
    of k3-1b on GPU (fla's kernels specialize on H and K; this reuses the compiled ones)."""
    tiny = load_config("k3-tiny")
    return tiny if smoke else tiny.replace(hidden_size=256, kda_num_heads=8, kda_head_dim=128)


@torch.no_grad()
def randomize_(module: nn.Module) -> nn.Module:
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


@contextlib.contextmanager
def per_expert_loop():
    """Force RoutedExperts onto its per-expert loop, whatever the device and dtype."""
    saved = experts_module.grouped_mm_available
    experts_module.grouped_mm_available = lambda x: False
    try:
        yield
    finally:
        experts_module.grouped_mm_available = saved


class Checker:
    """Runs named checks, records every comparison, and turns an exception into an ERROR record."""

    def __init__(self, device: torch.device, smoke: bool, record: Record, deadline: float):
        self.device, self.smoke, self.record, self.deadline = device, smoke, record, deadline
        self.fla = device.type == "cuda" and fla_kernels.available()
        self.fast = "fla" if self.fla else "recurrent"  # the path under test; recurrent stands in on CPU
        self.config = gpu_config(smoke)

    def compare(self, name: str, ref: torch.Tensor, out: torch.Tensor, bound: float, note: str = "") -> None:
        ref, out = ref.detach().float().cpu(), out.detach().float().cpu()
        if ref.shape != out.shape:
            self._emit(name, math.inf, bound, "FAIL", f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
        elif not torch.isfinite(out).all():
            self._emit(name, math.inf, bound, "FAIL", "non-finite values in output")
        else:
            err = rel_err(ref, out)
            self._emit(name, err, bound, "PASS" if err <= bound else "FAIL", note)

    def scalar(self, name: str, value: float, bound: float, note: str = "") -> None:
        """A measured error that is not a tensor comparison (e.g. a ratio that must be 0)."""
        self._emit(name, value, bound, "PASS" if value <= bound else "FAIL", note)

    def _emit(self, name: str, err: float, bound: float, status: str, note: str):
        self.record({"kind": "check", "name": name, "rel": err, "bound": bound, "status": status, "note": note})
        print(f"{name:<64} rel {err:9.2e}  bound {bound:7.0e}  {status}{'  ' + note if note else ''}", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.record({"kind": "check", "name": name, "status": "SKIP", "note": why})
        print(f"{name:<64} SKIP  {why}", flush=True)

    def run(self, name: str, fn: Callable[[], None], min_seconds: float) -> None:
        left = self.deadline - time.monotonic()
        if left < min_seconds:
            self.skip(name, f"time budget ({left:.0f}s left, needs ~{min_seconds:.0f}s)")
            return
        torch.manual_seed(0)  # every check reproducible on its own, whatever ran before it
        try:
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # surface asynchronous errors here, under this check's name
        except Exception as exc:  # one failing check must not stop the others
            detail = traceback.format_exc(limit=4)
            self.record({"kind": "check", "name": name, "status": "ERROR", "note": f"{type(exc).__name__}: {exc}",
                         "traceback": detail})
            print(f"{name:<64} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype)


# ----------------------------------------------------------------------------- (a) the KDA op
GRAD_NAMES = ("dq", "dk", "dv", "draw gate", "dbeta", "dh0", "dA_log", "ddt_bias")


def _kda_grads(impl: str, leaves: list[torch.Tensor], lower_bound: float | None, do, ds, cu=None):
    """kda as the layer calls it: raw gate projections activated by the op (in fla's kernels on
    CUDA), leaves = q, k, v, raw gate, beta, initial state, A_log, dt_bias."""
    gate = DecayGate(leaves[6], leaves[7], lower_bound)
    o, s = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, impl=impl, gate=gate)
    grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)
    return o, s, grads


def kda_vs_reference(c: Checker, dtype: torch.dtype, form: str, lengths: list[int] | None = None) -> None:
    """The path "auto" takes for `dtype` (bf16: fla, gate activated in-kernel, safe_gate for the
    bounded form; fp32: the torch chunk path on CUDA) vs an fp32 reference on the SAME values
    upcast, so the error measures the kernel, not input rounding: the chunk path for bf16, the
    token-by-token recurrence for fp32 (a different algorithm than the chunk path under test). The
    raw gate, its parameters and the state stay fp32, as the layer passes them. Outputs, final
    states and the gradients of every input."""
    H, K = c.config.kda_num_heads, c.config.kda_head_dim
    if lengths is None:
        B, T, N, cu = (1, 40, 1, None) if c.smoke else (2, 1000, 2, None)
    else:
        B, T, N = 1, sum(lengths), len(lengths)
        cu = torch.tensor([0, *lengths], device=c.device).cumsum(0)
    q, k, v, _, beta, h0 = (t.to(c.device) for t in make_inputs(B, T, H, K, K, form, N=N))
    raw, gate = make_gate(B, T, H, K, form)
    keep_fp32 = (3, 5, 6, 7)
    fast_in = [t.to(c.device) if i in keep_fp32 else t.to(dtype)
               for i, t in enumerate((q, k, v, raw, beta, h0, gate.A_log, gate.dt_bias))]
    fast_leaves = [t.detach().clone().requires_grad_() for t in fast_in]
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in fast_in]
    do, ds = c.randn(B, T, H, K), c.randn(N, H, K, K)
    fp32 = dtype == torch.float32
    impl, ref_impl = ("auto", "recurrent") if fp32 else (c.fast, "chunk")
    o_ref, s_ref, g_ref = _kda_grads(ref_impl, ref_leaves, gate.lower_bound, do, ds, cu)
    o, s, g_out = _kda_grads(impl, fast_leaves, gate.lower_bound, do, ds, cu)
    bound = FP32 if fp32 else BF16
    shape = f"B{B} T{T}" if cu is None else f"packed {lengths}"
    name = f"kda[{impl}] {form} gate {str(dtype).removeprefix('torch.')} {shape} vs {ref_impl}"
    c.compare(f"{name} o", o_ref, o, bound)
    c.compare(f"{name} final state", s_ref, s, bound)
    for grad_name, r, out in zip(GRAD_NAMES, g_ref, g_out):
        if grad_name == "dA_log" and not fp32:  # one seed's 8 head sums: dA_log_over_seeds bounds it
            continue
        c.compare(f"{name} {grad_name}", r, out, bound)
    gate_parameter_reductions(c, name, fast_leaves[3], fast_leaves[7], gate.lower_bound, g_out)


def gate_parameter_reductions(c: Checker, name: str, raw: torch.Tensor, dt_bias: torch.Tensor,
                              lower_bound: float | None, grads) -> None:
    """A_log and dt_bias act on every token's gate, so their gradients are sums over tokens of the
    raw-gate gradient the path returned, times a known factor (z = raw + dt_bias; softplus gate:
    dA_log = sum draw * softplus(z) / sigmoid(z); bounded gate: dA_log = sum draw * z; both:
    ddt_bias = sum draw). Recomputed here in fp64 from the path's own draw gate, they show whether
    the path adds error when it reduces, apart from the error it already has per token: the check
    against the reference above also carries how much the sum amplifies that per-token error."""
    H, K = raw.shape[-2:]
    z = raw.detach().double() + dt_bias.detach().double().view(H, K)
    draw = grads[3].detach().double()
    factor = z if lower_bound is not None else torch.nn.functional.softplus(z) / torch.sigmoid(z)
    c.compare(f"{name} dA_log = fp64 sum of its own draw gate", (draw * factor).sum((0, 1, 3)), grads[6], FP32)
    c.compare(f"{name} ddt_bias = fp64 sum of its own draw gate", draw.sum((0, 1)).flatten(), grads[7], FP32)


def dA_log_over_seeds(c: Checker, seeds: int = 8) -> None:
    """fla's bf16 dA_log [H] against the fp32 chunk path at B 2, T 1000, for both gate forms, the
    RMSE ratio pooled over the heads of `seeds` seeds: each head's gradient is a sum over every
    token and key whose terms largely cancel, so one seed's 8 sums give a ratio that swings 5x with
    the seed (tests/test_kda_fla.py::test_fla_gate_parameter_gradient_over_seeds)."""
    from bench.kda_gate_precision import measure

    for form in ("lb", "softplus"):
        path = "fla, gate in-kernel"
        pairs = [measure(form, seed, "both", paths=(path,))[path][2] for seed in range(seeds)]
        c.compare(f"kda[fla] {form} gate bf16 B2 T1000 dA_log, {seeds} seeds pooled vs chunk",
                  torch.cat([r for r, _ in pairs]), torch.cat([o for _, o in pairs]), BF16,
                  note="per seed: " + ", ".join(f"{rel_err(r, o):.1e}" for r, o in pairs))


def _prefix_inputs(c: Checker, T: int, i: int, dtype: torch.dtype):
    """Two input sets (q, k, v, raw gate, beta) equal before position i and independently random
    from i on."""
    H, K = c.config.kda_num_heads, c.config.kda_head_dim
    first, other = [[*make_inputs(1, T, H, K, K, "lb", with_state=False)[:3], make_gate(1, T, H, K, "lb")[0],
                     make_inputs(1, T, H, K, K, "lb", with_state=False)[4]] for _ in range(2)]
    second = [torch.cat([a[:, :i], b[:, i:]], dim=1) for a, b in zip(first, other)]
    return [[t.to(c.device, dtype if j != 3 else torch.float32) for j, t in enumerate(s)] for s in (first, second)]


def prefix_invariance(c: Checker, label: str, op: Callable, dtype: torch.dtype) -> None:
    """Change every input from position i on: outputs before i, and the gradients of a loss that
    reads only outputs before i, must not move (fla issue #1240: with its safe gate, fla's
    sub-chunk anchor could lie in the future), and gradients from i on must be 0; running the first
    i tokens alone must give the same outputs too (appending is invisible). i sits inside a
    16-token sub-chunk, where #1240's anchor row lies in the future."""
    T, i = (40, 21) if c.smoke else (1000, 437)
    H, K = c.config.kda_num_heads, c.config.kda_head_dim
    do = c.randn(1, i, H, K)
    input_sets = _prefix_inputs(c, T, i, dtype)
    runs = []
    for inputs in input_sets:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o = op(*leaves)
        grads = torch.autograd.grad((o[:, :i].float() * do).sum(), leaves)
        runs.append((o, grads))
    (o1, g1), (o2, g2) = runs
    c.compare(f"{label} outputs before i", o1[:, :i], o2[:, :i], EXACT)
    with torch.no_grad():
        alone = op(*[t[:, :i] for t in input_sets[0]])
    c.compare(f"{label} first i tokens alone", o1[:, :i], alone, EXACT)
    for grad_name, a, b in zip(("dq", "dk", "dv", "draw gate", "dbeta"), g1, g2):
        c.compare(f"{label} {grad_name} before i", a[:, :i], b[:, :i], EXACT)
        leak = a[:, i:].float().pow(2).mean().sqrt() / a[:, :i].float().pow(2).mean().sqrt().clamp_min(1e-30)
        c.scalar(f"{label} {grad_name} from i on (rms / rms before i)", leak.item(), EXACT)


def gated_kda_op(c: Checker, impl: str) -> Callable:
    """kda with the bounded gate activated by the op (fla: in-kernel, safe_gate), fixed parameters."""
    H, K = c.config.kda_num_heads, c.config.kda_head_dim
    gate = make_gate(1, 1, H, K, "lb")[1]
    gate = DecayGate(gate.A_log.to(c.device), gate.dt_bias.to(c.device), gate.lower_bound)

    def run(q, k, v, raw, beta):
        return kda(q, k, v, raw, beta, impl=impl, gate=gate)[0]
    return run


def conv_vs_reference(c: Checker, dtype: torch.dtype) -> None:
    """The causal short conv "auto" runs (fla's on CUDA) in `dtype` vs the torch reference in fp32 on
    the same values upcast: packed sequences (one shorter than the kernel) with initial tails, SiLU
    fused; outputs, final tails and the gradients of x, the weight and the initial tails."""
    lengths = [1, 5, 20] if c.smoke else [1, 3, 700, 64, 4000]
    C, W = 3 * c.config.kda_num_heads * c.config.kda_head_dim, c.config.short_conv_kernel_size
    cu = torch.tensor([0, *lengths], device=c.device).cumsum(0)
    inputs = [c.randn(1, sum(lengths), C).to(dtype), (c.randn(C, W) / W).to(dtype),
              c.randn(len(lengths), C, W - 1).to(dtype)]
    dy, dtail = c.randn(1, sum(lengths), C), c.randn(len(lengths), C, W - 1)
    runs = []
    for impl, run_dtype in (("torch", torch.float32), ("auto", dtype)):
        leaves = [t.detach().to(run_dtype).requires_grad_() for t in inputs]
        y, tails = causal_conv1d(leaves[0], leaves[1], initial_state=leaves[2], cu_seqlens=cu,
                                 output_final_state=True, activation="silu", impl=impl)
        runs.append((y, tails, *torch.autograd.grad((y.float() * dy).sum() + (tails.float() * dtail).sum(), leaves)))
    fp32 = dtype == torch.float32
    name = f"causal conv[auto] {str(dtype).removeprefix('torch.')} packed {lengths} vs torch fp32"
    for part, ref, out in zip(("y", "final tails", "dx", "dweight", "dtails"), *runs):
        c.compare(f"{name} {part}", ref, out, FP32 if fp32 else BF16)


def norm_gate_vs_reference(c: Checker, dtype: torch.dtype) -> None:
    """KDA's output norm-gate as "auto" runs it (fla's kernel on CUDA) in `dtype` vs the torch
    reference in fp32 on the same values upcast: outputs and the gradients of o, gate and weight."""
    H, K = c.config.kda_num_heads, c.config.kda_head_dim
    T = 50 if c.smoke else 3000
    inputs = [c.randn(2, T, H, K).to(dtype), c.randn(2, T, H, K).to(dtype), 0.5 + torch.rand(K, device=c.device)]
    dy = c.randn(2, T, H, K)
    runs = []
    for impl, run_dtype in (("torch", torch.float32), ("auto", dtype)):
        leaves = [t.detach().to(run_dtype if i < 2 else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
        y = rms_norm_gated(*leaves, eps=c.config.rms_norm_eps, impl=impl)
        runs.append((y, *torch.autograd.grad((y.float() * dy).sum(), leaves)))
    name = f"norm-gate[auto] {str(dtype).removeprefix('torch.')} T{T} vs torch fp32"
    for part, ref, out in zip(("y", "do", "dgate", "dweight"), *runs):
        c.compare(f"{name} {part}", ref, out, FP32 if dtype == torch.float32 else BF16)


def checks_kda(c: Checker) -> None:
    lengths = [1, 5, 20] if c.smoke else [1, 63, 64, 200, 672]  # awkward: 1, odd, one chunk, partial
    c.run("kda bf16", lambda: kda_vs_reference(c, torch.bfloat16, "lb"), 40)
    c.run("kda prefix invariance", lambda: prefix_invariance(c, f"kda[{c.fast}] lb gate bf16 prefix",
                                                             gated_kda_op(c, c.fast), torch.bfloat16), 20)
    c.run("kda packed bf16", lambda: kda_vs_reference(c, torch.bfloat16, "lb", lengths), 40)
    c.run("kda softplus bf16", lambda: kda_vs_reference(c, torch.bfloat16, "softplus"), 40)
    if c.fla:
        c.run("kda dA_log over seeds", lambda: dA_log_over_seeds(c), 40)
    c.run("kda fp32", lambda: kda_vs_reference(c, torch.float32, "lb"), 40)
    c.run("causal conv bf16", lambda: conv_vs_reference(c, torch.bfloat16), 15)
    c.run("causal conv fp32", lambda: conv_vs_reference(c, torch.float32), 15)
    c.run("norm-gate bf16", lambda: norm_gate_vs_reference(c, torch.bfloat16), 10)
    c.run("norm-gate fp32", lambda: norm_gate_vs_reference(c, torch.float32), 10)


# ----------------------------------------------------------------------------- (b, c, e) layers and model
def _layer_pass(layer: KimiDeltaAttention, x: torch.Tensor, state: KDAState, dy, ds, autocast: bool):
    """Forward with a state, backward of a loss on outputs and the new state; returns outputs, the
    new state and the gradients of x and of every parameter (by name)."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = layer(x, state=state)
    names, params = zip(*layer.named_parameters())
    loss = (y.float() * dy).sum() + (state.recurrent * ds).sum()
    grads = torch.autograd.grad(loss, (x, *params))
    return y, state, grads[0], dict(zip(names, grads[1:]))


def _worst_param(c: Checker, name: str, ref: dict, out: dict, bound: float, extra: str = "") -> None:
    errs = {n: rel_err(ref[n].float().cpu(), out[n].float().cpu()) for n in ref}
    worst = max(errs, key=errs.get)
    c.compare(f"{name} (worst: {worst})", ref[worst], out[worst], bound,
              note=f"{len(errs)} parameter gradients" + (f"; {extra}" if extra else ""))


def check_kda_layer(c: Checker) -> None:
    """KimiDeltaAttention on the device ("auto": fla's conv, and fla's KDA for bf16 / the torch chunk
    path for fp32, on CUDA) vs the same weights on CPU fp32 (torch), continuing a random decode
    state: outputs, new recurrent state, conv tails, all gradients. Both gate families: K3's
    lower-bounded sigmoid gate, and Kimi Linear's softplus gate (its decay parameters at their
    official init: unit-scale ones would decay by e^-10 per token, a regime no checkpoint is in)."""
    k3_gate = c.config.replace(kda_impl="auto")
    kimi_linear_gate = k3_gate.replace(gate_lower_bound=None, use_full_rank_gate=False)
    _check_kda_layer(c, "KDA layer", k3_gate, randomize_decay=True)
    _check_kda_layer(c, "KDA layer (Kimi Linear gate)", kimi_linear_gate, randomize_decay=False)


def _check_kda_layer(c: Checker, kind: str, cfg: K3Config, randomize_decay: bool) -> None:
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    decay = {n: p.detach().clone() for n, p in layer.named_parameters() if n in ("A_log", "dt_bias")}
    randomize_(layer)
    if not randomize_decay:
        with torch.no_grad():
            for n, p in layer.named_parameters():
                if n in decay:
                    p.copy_(decay[n])
    B, T = (1, 20) if c.smoke else (2, 300)
    x = torch.randn(B, T, cfg.hidden_size)
    state = KDAState.empty(cfg, B)
    state.conv.normal_()
    state.recurrent.normal_(0.0, 0.5)
    dy, ds = torch.randn(B, T, cfg.hidden_size), torch.randn_like(state.recurrent)

    def on(device):
        s = KDAState(state.conv.clone().to(device), state.recurrent.clone().to(device))
        return copy.deepcopy(layer).to(device), x.to(device), s, dy.to(device), ds.to(device)

    cpu = torch.device("cpu")
    y_ref, s_ref, dx_ref, dp_ref = _layer_pass(*on(cpu), autocast=False)
    # bf16 bounds calibrated on the torch reference itself: the CPU chunk path under the same bf16
    # autocast sets the error bf16 costs this layer (1.1e-2 on q/k projection gradients; A_log's [H]
    # gradient is a sum over B*T*K terms that cancel, so its error over 8 heads swings 2x by seed:
    # 0.8e-2..2.0e-2 on CPU); the device may be at most twice as far off.
    cpu_bf16 = _layer_pass(*on(cpu), autocast=True)
    ref = (y_ref, s_ref.recurrent, s_ref.conv, dx_ref)
    floor = [rel_err(r, o) for r, o in zip(ref, (cpu_bf16[0], cpu_bf16[1].recurrent, cpu_bf16[1].conv, cpu_bf16[2]))]
    floor_params = max(rel_err(dp_ref[n], cpu_bf16[3][n]) for n in dp_ref)
    for mode, autocast in (("fp32", False), ("bf16 autocast", True)):
        y, s, dx, dp = _layer_pass(*on(c.device), autocast=autocast)
        name = f"{kind} {c.device.type}[auto] {mode} vs cpu fp32"
        outs = (y, s.recurrent, s.conv, dx)
        for part, r, o, e in zip(("y", "state", "conv tails", "dx"), ref, outs, floor):
            if autocast:
                c.compare(f"{name} {part}", r, o, max(BF16, 2 * e), note=f"cpu bf16 autocast: {e:.1e}")
            else:
                c.compare(f"{name} {part}", r, o, FP32)
        if autocast:
            _worst_param(c, f"{name} dparams", dp_ref, dp, max(BF16, 2 * floor_params),
                         extra=f"cpu bf16 autocast worst: {floor_params:.1e}")
        else:
            _worst_param(c, f"{name} dparams", dp_ref, dp, FP32)


def check_mla(c: Checker) -> None:
    """Gated MLA with a cache: a packed prefill of two sequences, then 3 single-token decode steps.
    bf16 weights on the device, naive and absorbed, vs fp32 naive on CPU; fp32 absorbed too."""
    cfg = c.config
    layer = randomize_(GatedMLA(cfg, layer_idx=3))
    lengths = [3, 7] if c.smoke else [37, 100]
    N, steps = len(lengths), 3
    cu = torch.tensor([0, *lengths]).cumsum(0)
    x_prefill = torch.randn(1, sum(lengths), cfg.hidden_size)
    x_steps = torch.randn(steps, N, 1, cfg.hidden_size)

    @torch.no_grad()
    def run(device, dtype, impl):
        m = copy.deepcopy(layer).to(device, dtype)
        m.config = cfg.replace(mla_impl=impl)
        state = MLAState.empty(cfg, N, device, dtype, capacity=max(lengths) + steps)
        outs = [m(x_prefill.to(device, dtype), cu_seqlens=cu.to(device), state=state)[0]]
        outs += [m(x.to(device, dtype), state=state)[:, 0] for x in x_steps]
        return torch.cat(outs), torch.cat([state.rows(n) for n in range(N)])

    y_ref, lat_ref = run(torch.device("cpu"), torch.float32, "naive")
    for dtype, impl, bound in ((torch.bfloat16, "naive", BF16), (torch.bfloat16, "absorb", BF16),
                               (torch.float32, "absorb", FP32)):
        y, lat = run(c.device, dtype, impl)
        name = f"MLA {c.device.type} {str(dtype).removeprefix('torch.')} {impl} vs cpu fp32 naive"
        c.compare(f"{name} outputs (prefill + 3 decode)", y_ref, y, bound)
        c.compare(f"{name} cached latents", lat_ref, lat, bound)


def _model(smoke: bool) -> K3ForCausalLM:
    """The model at its own init, every token routed to every expert. Whole-model comparisons are
    ill-conditioned otherwise: with top-k routing, bf16 rounding flips near-tied expert choices
    (a discrete jump per flipped token; measured on CPU: 7% logits rel error at k=2 vs 1% at k=E),
    and unit-scale random weights make 8 layers chaotic (1e-3 input noise -> 2..13% logits).
    The routed path itself is checked exactly by the `moe` group."""
    cfg = model_config(smoke)
    return K3ForCausalLM(cfg.replace(num_experts_per_token=cfg.num_experts))


def _bf16_reference(model: K3ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fp32 logits on CPU of the model with its weights rounded to bf16 (what a bf16 model holds;
    the rounding itself is not the fast path's error), and how far the CPU torch path's own bf16
    forward is from them: the error bf16 arithmetic costs this model, whatever the device. Eight
    layers of bf16 activations lose ~1.2e-2 (measured on CPU), more than one op's 1e-2, so whole-model
    bf16 comparisons are bounded by that floor rather than by the per-op bar."""
    bf16 = copy.deepcopy(model).cpu().to(torch.bfloat16)
    with torch.no_grad():
        reference = copy.deepcopy(bf16).float()(ids.cpu())
        floor = rel_err(reference, bf16(ids.cpu()))
    return reference, floor


def _model_bound(floor: float) -> float:
    return max(BF16, 1.25 * floor)


def check_model_logits(c: Checker) -> None:
    """A whole k3-tiny-shaped model: device logits vs CPU fp32 logits (fp32), and bf16 weights on
    the device vs the same rounded weights in fp32 on CPU."""
    model = _model(c.smoke).eval()
    B, T = (1, 12) if c.smoke else (2, 200)
    ids = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad():
        ref32 = model(ids)
    ref16, floor = _bf16_reference(model, ids)
    for dtype, ref, bound, note in ((torch.bfloat16, ref16, _model_bound(floor), f"cpu bf16: {floor:.1e}; "),
                                    (torch.float32, ref32, FP32, "")):
        with torch.no_grad():
            out = copy.deepcopy(model).to(c.device, dtype)(ids.to(c.device))
        agree = (out.argmax(-1).cpu() == ref.argmax(-1)).float().mean().item()
        c.compare(f"model {c.device.type} {str(dtype).removeprefix('torch.')} logits vs cpu fp32", ref, out,
                  bound, note=f"{note}argmax agreement {agree:.1%}")


@torch.no_grad()
def _graph_decode(m: K3ForCausalLM, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits [B, steps, V] of the last `steps` tokens of ids [B, T]: a prefill of the rest into a
    cache, then one decode step per token replayed from a CUDA graph."""
    B, T = ids.shape
    cache = K3Cache.empty(m.config, B, device=ids.device, dtype=next(m.parameters()).dtype, capacity=T)
    m(ids[:, :-steps], cache=cache)
    decoder = CUDAGraphDecoder(m, cache)
    return torch.stack([decoder.step(ids[:, T - steps + t]).clone() for t in range(steps)], 1)


def check_model_decode(c: Checker) -> None:
    """On the device: a prefill of T-4 tokens into a cache followed by 4 single-token steps (chunk
    then recurrent kernels), eager and replayed from a CUDA graph, gives the last 4 logits of one
    full forward. fp32: against the device's own full forward (the property itself); bf16: against
    the fp32 reference of the same rounded weights, where the full forward must be too (two bf16
    paths compared with each other would count both their roundings)."""
    model = _model(c.smoke).eval()
    B, T, steps = (1, 12, 4) if c.smoke else (2, 200, 4)
    ids = torch.randint(0, model.config.vocab_size, (B, T), device=c.device)
    ref16, floor = _bf16_reference(model, ids)
    for dtype in (torch.bfloat16, torch.float32):
        label = str(dtype).removeprefix("torch.")
        m = copy.deepcopy(model).to(c.device, dtype)
        with torch.no_grad():
            full = m(ids)[:, -steps:]
            cache = K3Cache.empty(m.config, B, device=c.device, dtype=dtype)
            m(ids[:, :-steps], cache=cache)
            stepped = torch.cat([m(ids[:, T - steps + t:T - steps + t + 1], cache=cache) for t in range(steps)], 1)
        if dtype == torch.float32:
            ref, bound, what = full, FP32, "decode = prefill"
        else:
            ref, bound, what = ref16[:, -steps:], _model_bound(floor), "decode vs cpu fp32"
            c.compare(f"model {c.device.type} {label} prefill vs cpu fp32 (last {steps} logits)", ref, full, bound,
                      note=f"cpu bf16: {floor:.1e}")
        c.compare(f"model {c.device.type} {label} {what} (last {steps} logits)", ref, stepped, bound)
        graph_name = f"model cuda {label} CUDA-graph {what} (last {steps} logits)"
        if c.device.type == "cuda" and not capturable_experts(m):
            c.skip(graph_name, "routed experts run the per-expert loop here (host-side counts; grouped_mm needs bf16 on sm90): not capturable")
        elif c.device.type == "cuda":  # the same steps replayed from a CUDA graph
            graphed = _graph_decode(m, ids, steps)
            c.compare(graph_name, ref, graphed, bound)
            c.compare(f"model cuda {label} CUDA-graph decode = eager decode (last {steps} logits)", stepped, graphed,
                      EXACT)


def check_compiled_model(c: Checker) -> None:
    """The model with its regions compiled by inductor (k3.regional_compile, as `k3 train
    --compile` and the decode bench's "graph+compile" rows run it), bf16 on the device: prefill and
    CUDA-graph decode steps against the fp32 reference of the same rounded weights, under the same
    bound as the eager model. Inductor fuses and reorders the bf16 arithmetic, so it is not expected
    to equal the eager path bit for bit; it must be as close to the reference."""
    model = _model(c.smoke).eval()
    B, T, steps = (1, 12, 4) if c.smoke else (2, 200, 4)
    ids = torch.randint(0, model.config.vocab_size, (B, T), device=c.device)
    ref16, floor = _bf16_reference(model, ids)
    m = copy.deepcopy(model).to(c.device, torch.bfloat16)
    if not capturable_experts(m):
        c.skip("model cuda bfloat16 compiled", "routed experts run the per-expert loop here (no grouped_mm): "
               "not capturable")
        return
    compile_regions(m)
    with torch.no_grad():
        full = m(ids)[:, -steps:]
    graphed = _graph_decode(m, ids, steps)
    ref, note = ref16[:, -steps:], f"cpu bf16: {floor:.1e}"
    c.compare(f"model cuda bfloat16 compiled prefill vs cpu fp32 (last {steps} logits)", ref, full,
              _model_bound(floor), note=note)
    c.compare(f"model cuda bfloat16 compiled CUDA-graph decode vs cpu fp32 (last {steps} logits)", ref, graphed,
              _model_bound(floor), note=note)


def checks_layers(c: Checker) -> None:
    # The KDA layer last: the slowest (CPU fp32 references, and on a cold Triton cache fla's conv and
    # qk-norm kernels compile here), it must not starve the checks before it.
    c.run("MLA layer", lambda: check_mla(c), 15)
    c.run("model decode", lambda: check_model_decode(c), 20)
    c.run("model logits", lambda: check_model_logits(c), 30)
    if c.device.type == "cuda":  # inductor compiles for a minute; CPU runs check the traced graphs in tests/
        c.run("compiled model", lambda: check_compiled_model(c), 60)
    c.run("KDA layer", lambda: check_kda_layer(c), 30)


# ----------------------------------------------------------------------------- (d) routed experts
def _routing(n: int, num_experts: int, k: int, device):
    """Random top-k routing that never picks every 7th expert, so some groups are empty."""
    scores = torch.rand(n, num_experts)
    scores[:, 3::7] = -1.0
    idx = scores.topk(k, dim=-1).indices
    weights = torch.softmax(torch.randn(n, k), dim=-1)
    return weights.to(device), idx.to(device)


def _experts_pass(bank: RoutedExperts, x, weights, idx, dy):
    x = x.detach().clone().requires_grad_()
    y = bank(x, weights, idx)
    grads = torch.autograd.grad((y.float() * dy).sum(), (x, bank.w1, bank.w3, bank.w2))
    return y, grads


def check_experts(c: Checker) -> None:
    """The routed-expert bank: bf16 through torch._grouped_mm (when sm90 makes it eligible) vs the
    per-expert loop in fp32 and in bf16; outputs and the gradients of x, w1, w3, w2."""
    cfg = c.config
    bank = randomize_(RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size))
    n = 64 if c.smoke else 4096
    x = torch.randn(n, cfg.moe_hidden_size, device=c.device)
    weights, idx = _routing(n, cfg.num_experts, cfg.num_experts_per_token, c.device)
    dy = torch.randn(n, cfg.moe_hidden_size, device=c.device)
    bank32 = copy.deepcopy(bank).to(c.device)
    bank16 = copy.deepcopy(bank).to(c.device, torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    path = "grouped_mm" if experts_module.grouped_mm_available(x16) else "per-expert loop"
    ref = _experts_pass(bank32, x, weights, idx, dy)  # fp32: always the loop
    fast = _experts_pass(bank16, x16, weights, idx, dy)
    with per_expert_loop():
        loop16 = _experts_pass(bank16, x16, weights, idx, dy)
    for label, other in ((f"bf16 {path} vs fp32 loop", ref), (f"bf16 {path} vs bf16 loop", loop16)):
        c.compare(f"experts {label} y", other[0], fast[0], BF16)
        for grad_name, r, out in zip(("dx", "dw1", "dw3", "dw2"), other[1], fast[1]):
            c.compare(f"experts {label} {grad_name}", r, out, BF16)


def check_moe_autocast(c: Checker) -> None:
    """Stable LatentMoE with fp32 parameters under bf16 autocast, which is how training runs.
    1. The router must score in fp32 (SPEC §6): the chosen experts must equal fp32's.
    2. With every expert chosen (no discrete choice left), outputs vs the fp32 layer; the routed
       experts then see bf16 activations and fp32 weights (grouped_mm on sm90)."""
    cfg = c.config
    x = torch.randn(2, 64 if c.smoke else 512, cfg.hidden_size, device=c.device)
    moe = StableLatentMoE(cfg).to(c.device)
    with torch.no_grad():
        flat = x.reshape(-1, cfg.hidden_size)
        _, idx_ref = moe.gate(flat)
        with torch.autocast(c.device.type, dtype=torch.bfloat16):
            _, idx = moe.gate(flat)
    changed = (idx.sort(-1).values != idx_ref.sort(-1).values).any(-1).float().mean().item()
    c.scalar("MoE router under bf16 autocast: tokens with other experts than fp32", changed, 0.0,
             note="router scores must stay fp32 (SPEC 6)")
    dense = StableLatentMoE(cfg.replace(num_experts_per_token=cfg.num_experts)).to(c.device)
    with torch.no_grad():
        ref = dense(x)
        with torch.autocast(c.device.type, dtype=torch.bfloat16):
            out = dense(x)
    c.compare("StableLatentMoE (k=E) fp32 params under bf16 autocast vs fp32", ref, out, BF16)


def checks_moe(c: Checker) -> None:
    c.run("experts", lambda: check_experts(c), 10)
    c.run("moe autocast", lambda: check_moe_autocast(c), 10)


GROUPS = {"kda": checks_kda, "layers": checks_layers, "moe": checks_moe}


def run_group(group: str, device: torch.device, smoke: bool, record: Record, deadline: float) -> None:
    GROUPS[group](Checker(device, smoke, record, deadline))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    results: list[dict] = []
    for group in args.only.split(","):
        run_group(group, device, args.smoke, results.append, deadline=math.inf)
    bad = [r for r in results if r["status"] in ("FAIL", "ERROR")]
    print(f"{len(results)} checks, {len(bad)} FAIL/ERROR")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
