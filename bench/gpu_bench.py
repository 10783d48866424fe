"""GPU benchmarks: what k3 does with one H200, against the ceilings measured in the same run.

    python -m bench.gpu_bench [--only train,kda,decode,moe,serve] [--seconds 500] [--jsonl FILE]
    python -m bench.gpu_bench --smoke          # every code path on CPU at tiny sizes
    python -m bench.gpu_bench --config k3-slice --batches 1,8,32 --only decode   # K3's widths
    python -m bench.gpu_bench --config k3-slice --layers 2 --only train          # fits 80 GB

`--config` (a preset or config.json; default k3-1b) is the model of train, kda, decode and moe;
`--layers N` cuts it to N layers (3:1 KDA:MLA, AttnRes blocks of N/2). k3-slice's 4 layers train
only on an H200: fp32 weights and AdamW state are 16 bytes a parameter.

- train:  one training step of the model at 4096 tokens per sequence (bf16 autocast, fp32 weights,
          fused AdamW), tokens/s and MFU against the measured bf16 matmul rate and the 989 TFLOP/s
          datasheet rate. FLOPs per token (k3/flops.py, the model `k3 plan` times steps with;
          stated in docs/BENCHMARKS.md too):
              6 * N_active                                  (N_active: k3/model/params.py — the
                                                             embedding excluded, lm_head and router in)
            + per MLA layer: 3 * T * H * (d_qk + d_v)       (causal: each query sees T/2 keys on
                                                             average, 2 FLOPs per multiply-add for
                                                             QK^T and PV; backward = 2x forward)
            + per KDA layer: 3 * H * (6 d^2 + 3 C d + C^2)  (Kimi Linear paper per head per token,
                                                             forward 6Td^2 + 3TCd + TC^2; x3 fwd+bwd)
- kda:    forward + backward of one layer, batch 1, T = 4K, 16K, 64K, bf16: k3's
          KimiDeltaAttention (fla path), fla's own `fla.layers.KimiDeltaAttention` (same heads and
          dims, K3 gate: safe_gate, lower bound -5), the bare KDA op as k3's layer calls it (fla's
          chunk_kda, gate in-kernel with safe_gate), k3's gated MLA layer, and causal SDPA with the
          same heads (d=128): ms, achieved TFLOP/s and ratios.
- decode: tokens/s of the model (bf16, absorbed MLA; CUDA-graph replay, eager at batch 1, then with
          compiled regions) at batch 1, 8, 64 and context 1K..128K, the cache
          built directly with random states and latents of the right size, against the bandwidth
          bound (bytes a step must read: weights incl. the expected distinct routed experts, KDA
          states read + written, MLA latents read; / measured copy bandwidth), and an all-MLA
          variant of the same model.
- moe:    the routed-expert bank, grouped_mm vs the per-expert loop, fwd+bwd at training size and
          forward at decode size.
- serve:  the k3 serving engine vs HF transformers `generate` on the same Kimi-Linear weights
          (bench.serve at GPU size).
Each size runs only while `--seconds` allows (the device tool stops a command at 10 minutes);
what is skipped is recorded as skipped. Each result is printed as a line when it is measured (and
appended to `--jsonl` FILE, so a run stopped early keeps what it had); the tables come last.
Correctness of these paths is tested, not measured here: `python -m pytest -m gpu`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import ceilings as ceilings_module
from bench.ceilings import H200_BF16_DENSE_TFLOPS, median_ms
from bench.common import per_expert_loop
from bench.serve_modes import K3_MODES, agreement_summary, mixed_line
from k3.config import K3Config, load_config
from k3.flops import causal_attention_flops, kda_flops_per_token, mla_flops_per_token, train_flops_per_token
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.experts import RoutedExperts, grouped_mm_available
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.transformer import K3ForCausalLM
from k3.ops import fla_kernels
from k3.ops.kda import DecayGate, kda
from k3.regional_compile import compile_regions
from k3.serve.decode_graph import CUDAGraphDecoder
from k3.train.balance import balance_step

Record = Callable[[dict], None]
GB = 1e9


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _say(record: Record, entry: dict) -> None:
    record(entry)
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in entry.items() if k not in ("kind",)}
    print(" ".join(f"{k}={v}" for k, v in shown.items()), flush=True)


def _skip(record: Record, bench: str, name: str, why: str) -> None:
    _say(record, {"kind": "bench", "bench": bench, "name": name, "status": "skipped", "note": why})


@dataclass
class Shape:
    """What main's arguments choose for every bench: the model (optionally cut to `layers`, the
    3:1 layout and two AttnRes blocks kept) and the decode batch sizes."""
    config: str = "k3-1b"
    layers: int | None = None
    batches: tuple[int, ...] = (1, 8, 64)

    def load(self, smoke: bool) -> K3Config:
        cfg = load_config("k3-tiny" if smoke else self.config)
        if self.layers and not smoke:
            cfg = cfg.replace(num_hidden_layers=self.layers, kda_layers=[], full_attn_layers=[],
                              attn_res_block_size=max(1, self.layers // 2))
        return cfg

    def name(self, smoke: bool) -> str:
        if smoke:
            return "k3-tiny"
        name = Path(self.config).stem if self.config.endswith(".json") else self.config
        return f"{name} L{self.layers}" if self.layers else name


SHAPE = Shape()


# ----------------------------------------------------------------------------- (1) training step
def bench_train(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float) -> None:
    _train(device, smoke, ceilings, record, deadline, "bf16 autocast, fp32 weights, fused AdamW")


def training_step(cfg: K3Config, device: torch.device):
    """The benchmarked step: bf16 autocast over fp32 master weights, next-token loss, fused AdamW,
    then Quantile Balancing's bias update from the step's router scores (as `k3 train` does)."""
    with torch.device(device):  # initialize on the device: 1.4B parameters initialize slowly on a CPU
        model = K3ForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance_step(model, "quantile")

    return model, opt, step


def _train(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float, note: str) -> None:
    cfg = SHAPE.load(smoke)
    T = 64 if smoke else 4096
    try:
        model, opt, step = training_step(cfg, device)
    except torch.cuda.OutOfMemoryError as exc:
        _skip(record, "train", SHAPE.name(smoke), f"the weights and AdamW state do not fit: {str(exc)[:120]}")
        return

    def batch(b: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (b, T + 1), device=device)

    probe = 1
    try:
        while True:  # a wide model's single 4096-token sequence may not fit: halve T down to 1024
            try:
                step(batch(probe))
                break
            except torch.cuda.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                _free(device)
                if T <= 1024:
                    _skip(record, "train", f"{SHAPE.name(smoke)} T{T} B1", "out of memory: not even one sequence of 1024 "
                          "tokens fits beside the fp32 weights and AdamW state (--layers cuts the model)")
                    return
                T //= 2
                note += f"; T halved to {T} (a 2T sequence did not fit)"
    except RuntimeError as exc:
        if "dtype" not in str(exc):  # out-of-memory never reaches here: the loop above records it
            raise
        # torch._grouped_mm is not autocast-aware (pytorch#174763): bf16 activations meet fp32
        # expert weights. Measure what runs: the routed-expert banks held in bf16.
        _say(record, {"kind": "bench", "bench": "train", "name": "autocast as written", "status": "error",
                      "note": f"{type(exc).__name__}: {str(exc)[:200]}"})
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.to(torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        note += "; routed experts in bf16 (workaround: grouped_mm under autocast)"
        step(batch(probe))
    B = probe
    if device.type == "cuda":
        # Size the batch from the probe's memory: static (weights, AdamW state) + per sequence.
        static = torch.cuda.memory_allocated()
        per_seq = max(torch.cuda.max_memory_allocated() - static, 1) / probe
        total = torch.cuda.get_device_properties(device).total_memory
        B = max(1, min(32, 2 ** int(math.log2(max(1.0, (0.8 * total - static) / per_seq)))))
    else:
        B = 2
    while True:
        try:
            ids = batch(B)
            _free(device)
            step(ids)  # the first step at a size JIT-compiles kernels for its shapes (tens of seconds)
            break
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            if B == 1:
                raise
            B //= 2
    t0 = time.monotonic()
    step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = time.monotonic() - t0
    flops = train_flops_per_token(cfg, T)

    def measure(label: str, step_s: float, detail: str = "") -> None:
        peak = torch.cuda.max_memory_allocated() / GB if device.type == "cuda" else float("nan")
        name = f"{SHAPE.name(smoke)} T{T} B{B} {label}"
        # do_bench runs at least 8 steps (1 + 5 to estimate + warm-up + repeats): fit them in the deadline.
        left = deadline - time.monotonic() - 5
        if left < 8 * step_s:
            _skip(record, "train", name, f"time budget: {left:.0f}s left, a step takes {step_s:.1f}s")
            return
        rep_ms = min(3000.0, (left - 7 * step_s) * 1e3) if not smoke else 200.0
        ms = median_ms(lambda: step(ids), device, warmup_ms=1, rep_ms=rep_ms)
        tokens_per_s = B * T / (ms / 1e3)
        achieved = tokens_per_s * flops["total"] / 1e12
        _say(record, {"kind": "bench", "bench": "train", "name": name,
                      "status": "ok", "ms_per_step": ms, "tokens_per_s": tokens_per_s, "tflops": achieved,
                      "mfu_measured_ceiling": achieved / ceilings["matmul_bf16_tflops"],
                      "mfu_datasheet": achieved / H200_BF16_DENSE_TFLOPS, "peak_mem_gb": peak,
                      "flops_per_token": flops, "note": note + detail})

    measure("eager", step_s)
    # Regional torch.compile (k3/regional_compile.py), as `k3 train --compile` runs; the first steps compile.
    compile_regions(model, backend="eager" if smoke else "inductor")
    _free(device)
    t0 = time.monotonic()
    for _ in range(2):  # forward and backward graphs, then one step that only replays
        step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    measure("compiled", step_s, f"; regional torch.compile, first 2 steps (compiling) took {time.monotonic() - t0:.0f}s")


# ----------------------------------------------------------------------------- (2) KDA vs attention layers
@dataclass
class Case:
    name: str
    build: Callable[[], Callable[[], None]]  # allocates inputs, returns the timed fwd+bwd
    flops: float  # one fwd+bwd under this file's conventions; 0 where none is stated (whole layers)
    quadratic: bool  # cost grows as T^2 (attention) rather than T


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    """One forward and backward; gradients returned, not accumulated, so repeats do equal work."""
    def run() -> None:
        out = fn()
        torch.autograd.grad(out, leaves, torch.randn_like(out), allow_unused=True)
    return run


def layer_fwd_bwd(layer: torch.nn.Module, x: torch.Tensor, pick: Callable = lambda y: y) -> Callable[[], None]:
    return _fwd_bwd(lambda: pick(layer(x)), [x, *layer.parameters()])


def _op(op: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    return _fwd_bwd(lambda: op(*inputs), inputs)


def _kda_inputs(T: int, H: int, K: int, device) -> list[torch.Tensor]:
    """Layer-like KDA op inputs: unit q/k, the raw gate projections kept fp32 as the layer passes them."""
    bf16 = torch.bfloat16
    q = F.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(bf16)
    k = F.normalize(torch.randn(1, T, H, K, device=device), dim=-1).to(bf16)
    v = torch.randn(1, T, H, K, device=device, dtype=bf16)
    raw_gate = torch.randn(1, T, H, K, device=device)
    beta = torch.sigmoid(torch.randn(1, T, H, device=device)).to(bf16)
    return [t.requires_grad_() for t in (q, k, v, raw_gate, beta)]


def _kda_op(cfg: K3Config, impl: str, device) -> Callable:
    """kda as the layer calls it: K3's bounded gate activated by the op (A_log 0: g = lb * sigmoid(raw))."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    gate = DecayGate(torch.zeros(H, device=device), torch.zeros(H * K, device=device), cfg.gate_lower_bound)
    return lambda *t: kda(*t, impl=impl, gate=gate)[0]


def fla_kda_layer(cfg: K3Config) -> torch.nn.Module:
    """flash-linear-attention's own layer (fla.layers ships in the flash-linear-attention wheel,
    not fla-core) with the model's heads and dims and the K3 gate (safe_gate, lower bound -5)."""
    from fla.layers import KimiDeltaAttention as FlaKimiDeltaAttention

    return FlaKimiDeltaAttention(hidden_size=cfg.hidden_size, head_dim=cfg.kda_head_dim,
                                 num_heads=cfg.kda_num_heads, safe_gate=True, lower_bound=cfg.gate_lower_bound,
                                 conv_size=cfg.short_conv_kernel_size, layer_idx=0, norm_eps=cfg.rms_norm_eps)


def _compiled(module: torch.nn.Module) -> torch.nn.Module:
    module.compile()
    return module


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def kda_cases(cfg: K3Config, T: int, device: torch.device, fla: bool) -> list[Case]:
    D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    bf16 = torch.bfloat16
    impl = "fla" if fla else "chunk"

    def x() -> torch.Tensor:
        return torch.randn(1, T, D, device=device, dtype=bf16, requires_grad=True)

    def heads() -> list[torch.Tensor]:
        return [torch.randn(1, H, T, K, device=device, dtype=bf16, requires_grad=True) for _ in range(3)]

    kda_flops = T * kda_flops_per_token(cfg)
    # Whole layers first (the comparison that matters: ours vs fla's layer), then the bare ops.
    cases = [Case(f"k3 KimiDeltaAttention layer [{impl}]",
                  lambda: layer_fwd_bwd(KimiDeltaAttention(cfg, 0).to(device, bf16), x()), 0.0, False)]
    if fla:
        cases.append(Case("fla.layers.KimiDeltaAttention layer",
                          lambda: layer_fwd_bwd(fla_kda_layer(cfg).to(device, bf16), x(), pick=lambda out: out[0]), 0.0, False))
    if device.type == "cuda":  # what `k3 train --compile` runs (k3/regional_compile.py); compiles per length
        cases.append(Case(f"k3 KimiDeltaAttention layer [{impl}] compiled",
                          lambda: layer_fwd_bwd(_compiled(KimiDeltaAttention(cfg, 0).to(device, bf16)), x()), 0.0, False))
    cases += [
        Case(f"k3 kda op [{impl}]",
             lambda: _op(_kda_op(cfg, impl, device), _kda_inputs(T, H, K, device)), kda_flops, False),
        Case("k3 GatedMLA layer (naive, SDPA)",
             lambda: layer_fwd_bwd(GatedMLA(cfg, 3).to(device, bf16), x()), T * mla_flops_per_token(cfg, T), True),
        Case(f"SDPA causal op ({H} heads, d={K})",
             lambda: _op(_sdpa_causal, heads()), causal_attention_flops(T, H, K, K), True),
    ]
    return cases


def sdpa_backends_for_mla(cfg: K3Config, device: torch.device, record: Record) -> None:
    """Which fused SDPA kernels accept MLA's shapes (d_qk = 192 != d_v = 128) in bf16: without one,
    the naive MLA path falls back to the math kernel (T^2 scores in memory)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, T = cfg.num_attention_heads, 1024
    q, k = (torch.randn(1, H, T, cfg.qk_head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, H, T, cfg.v_head_dim, device=device, dtype=torch.bfloat16)
    usable = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            usable.append(backend.name)
        except RuntimeError:
            pass
    _say(record, {"kind": "bench", "bench": "kda", "name": "SDPA kernels accepting MLA shapes (192/128, bf16)",
                  "status": "ok", "usable": ",".join(usable) or "none (math fallback)"})


def bench_kda(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float) -> None:
    cfg = SHAPE.load(smoke)
    fla = device.type == "cuda" and fla_kernels.available()
    if device.type == "cuda":
        sdpa_backends_for_mla(cfg, device, record)
    lengths = (64, 128) if smoke else (4096, 16384, 65536)
    results: dict[int, dict[str, float]] = {T: {} for T in lengths}
    # Case-major: each case runs all its lengths before the next case compiles anything, so a slow
    # first compile costs the cases after it, not the lengths of earlier ones.
    for i in range(len(kda_cases(cfg, lengths[0], device, fla))):
        previous: tuple[int, float] | None = None
        for T in lengths:
            case = kda_cases(cfg, T, device, fla)[i]
            name = f"{case.name} T{T}"
            predicted_s = 5.0
            if previous is not None:  # from the last length: linear in T, quadratic for attention
                predicted_s = 12 * previous[1] * (T / previous[0]) ** (2 if case.quadratic else 1) / 1e3
            if time.monotonic() + predicted_s + 5 > deadline:
                _skip(record, "kda", name, f"time budget (predicted {predicted_s:.0f}s)")
                continue
            fn = None
            try:
                fn = case.build()
                ms = median_ms(fn, device, warmup_ms=10, rep_ms=200 if not smoke else 50)
            except torch.cuda.OutOfMemoryError as exc:
                _skip(record, "kda", name, f"out of memory: {str(exc)[:120]}")
                continue
            except Exception as exc:  # noqa: BLE001 (e.g. fla.layers missing: this case stops, the others run)
                _say(record, {"kind": "bench", "bench": "kda", "name": name, "status": "error",
                              "note": f"{type(exc).__name__}: {str(exc)[:200]}"})
                break
            finally:
                del fn
                _free(device)
            previous = (T, ms)
            results[T][case.name] = ms
            entry = {"kind": "bench", "bench": "kda", "name": name, "status": "ok", "T": T, "ms_fwd_bwd": ms}
            if case.flops:
                entry["tflops"] = case.flops / (ms * 1e-3) / 1e12
            _say(record, entry)
    for T, by_case in results.items():
        sdpa = next((ms for n, ms in by_case.items() if n.startswith("SDPA")), None)
        if sdpa:
            _say(record, {"kind": "bench", "bench": "kda", "name": f"ratio to SDPA causal T{T}", "status": "ok",
                          **{n: ms / sdpa for n, ms in by_case.items() if not n.startswith("SDPA")}})
        fla_layer = by_case.get("fla.layers.KimiDeltaAttention layer")
        if fla_layer:  # the target: our layer at least as fast as fla's (ratio >= 1)
            _say(record, {"kind": "bench", "bench": "kda", "name": f"speed vs fla's layer (fla ms / ours) T{T}",
                          "status": "ok", **{n: fla_layer / ms for n, ms in by_case.items()
                                             if n.startswith("k3 KimiDeltaAttention layer")}})


# ----------------------------------------------------------------------------- (3) decode
def all_mla(cfg: K3Config) -> K3Config:
    """The same model with every layer MLA (what KDA replaces)."""
    return cfg.replace(kda_layers=[], full_attn_layers=list(range(1, cfg.num_hidden_layers + 1)))


def random_cache(cfg: K3Config, batch: int, context: int, device, dtype, capacity: int) -> K3Cache:
    """A decode state as if `context` tokens had been consumed: random (never zero) KDA states and
    conv tails, random latents. Building it directly avoids a 128K-token prefill per sequence."""
    cache = K3Cache.empty(cfg, batch, device=device, dtype=dtype, capacity=capacity)
    for state in cache.layers:
        if isinstance(state, KDAState):
            state.conv.normal_()
            state.recurrent.normal_(0.0, 0.02)
        else:
            state.buffer.normal_()
            state.lengths.fill_(context)
    cache.lengths.fill_(context)
    return cache


def cache_bytes(cfg: K3Config, batch: int, context: int, elem: int) -> int:
    kda = cfg.num_kda_layers * batch * (cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 +
                                        3 * cfg.kda_num_heads * cfg.kda_head_dim * (cfg.short_conv_kernel_size - 1) * elem)
    mla = cfg.num_mla_layers * batch * context * cfg.mla_cache_width * elem
    return kda + mla


def decode_step_bytes(model: K3ForCausalLM, batch: int, context: int) -> dict:
    """The fewest bytes one decode step must move: every weight once, except that only the rows of
    the B tokens are read from the embedding and only the routed experts some token picks (expected
    distinct experts E (1 - (1 - k/E)^B) per MoE layer); KDA states and conv tails read and written
    back; MLA latents read, one new row written."""
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_token
    used = 1 - (1 - k / E) ** batch if E else 0.0
    expert_ids = {id(p) for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
    weights = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name == "model.embed_tokens.weight":
            size = batch * p.shape[1] * p.element_size()
        elif id(p) in expert_ids:
            size *= used
        weights += size
    elem = next(model.parameters()).element_size()
    state = 2 * cfg.num_kda_layers * batch * (cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 +
                                              3 * cfg.kda_num_heads * cfg.kda_head_dim * (cfg.short_conv_kernel_size - 1) * elem)
    latents = cfg.num_mla_layers * batch * (context + 1) * cfg.mla_cache_width * elem
    return {"weights": weights, "kda_states": state, "mla_latents": latents, "total": weights + state + latents}


DECODE_STEPS_PER_CALL = 32  # timed back to back, then the cache lengths are reset to the context


def bench_decode(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float) -> None:
    base = SHAPE.load(smoke).replace(mla_impl="absorb")
    dtype = torch.bfloat16
    batches, contexts = ((1, 2), (16, 64)) if smoke else (SHAPE.batches, (1024, 8192, 32768, 131072))
    budget_bytes = 0.55 * (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 4 * GB)
    models, compiled = {}, {}
    for variant, cfg in (("hybrid", base), ("all-MLA", all_mla(base))):
        with torch.device(device):
            models[variant] = K3ForCausalLM(cfg).to(dtype).eval()
    last_step_s = 0.05

    def case(variant: str, batch: int, context: int, mode: str) -> bool:
        """Measure and record one row; False when the decode path itself failed."""
        nonlocal last_step_s
        model, graphed = (compiled if mode == "graph+compile" else models)[variant], mode != "eager"
        name = f"{variant} B{batch} ctx{context} {mode}"
        need = cache_bytes(model.config, batch, context, 2)
        if need > budget_bytes:
            _skip(record, "decode", name, f"cache {need / GB:.0f} GB over the {budget_bytes / GB:.0f} GB allowance")
            return True
        # a row takes ~12 timed calls of DECODE_STEPS_PER_CALL steps, plus building the cache and the graph
        if time.monotonic() + 12 * DECODE_STEPS_PER_CALL * last_step_s + 5 > deadline:
            _skip(record, "decode", name, "time budget")
            return True
        try:
            ms = _decode_ms(model, batch, context, device, dtype, smoke, graphed)
        except torch.cuda.OutOfMemoryError as exc:
            _skip(record, "decode", name, f"out of memory: {str(exc)[:120]}")
            return True
        except Exception as exc:  # noqa: BLE001 (a failing decode path fails every size alike: say so once)
            _say(record, {"kind": "bench", "bench": "decode", "name": name, "status": "error",
                          "note": f"{type(exc).__name__}: {str(exc)[:200]}"})
            return False
        finally:
            _free(device)
        last_step_s = max(last_step_s, ms / 1e3) if graphed else last_step_s
        # the timed steps see contexts context .. context + steps: count the middle one
        moved = decode_step_bytes(model, batch, context + DECODE_STEPS_PER_CALL // 2)
        bound_ms = moved["total"] / (ceilings["copy_gbps"] * GB) * 1e3
        _say(record, {"kind": "bench", "bench": "decode", "name": name, "status": "ok", "variant": variant,
                      "mode": mode, "batch": batch, "context": context, "ms_per_step": ms,
                      "tokens_per_s": batch / (ms / 1e3), "bound_ms": bound_ms,
                      "bound_tokens_per_s": batch / (bound_ms / 1e3), "fraction_of_bound": bound_ms / ms,
                      "bytes": moved})
        return True

    # Where the all-MLA cache of the largest batch is over the allowance (128K at B 64), also the
    # largest power-of-two batch at which both variants fit: the hybrid / all-MLA ratio needs a pair.
    def both_fit(batch: int, context: int) -> bool:
        return all(cache_bytes(m.config, batch, context, 2) <= budget_bytes for m in models.values())

    grid = []
    for c in contexts:
        sizes = list(batches)
        fitting = sizes[-1]
        while fitting > 1 and not both_fit(fitting, c):
            fitting //= 2
        if fitting not in sizes:
            sizes = sorted(sizes + [fitting])
        grid += [(v, b, c) for b in sizes for v in models]
    if device.type != "cuda":
        all(case(variant, batch, context, "eager") for variant, batch, context in grid)
        return
    # In order of what the targets need, as the time budget may end the list: CUDA-graph replay of
    # the model with its regions compiled (k3/regional_compile.py: each layer's norms, mixer and FFN
    # and the AttnRes reads, which fuses the small kernels that dominate a small model's decode
    # step) over the whole grid; then uncompiled replay; then eager at batch 1 (where launch
    # overhead shows most).
    compiled = {variant: copy.deepcopy(model) for variant, model in models.items()}
    for model in compiled.values():
        compile_regions(model)
    if not all(case(variant, batch, context, "graph+compile") for variant, batch, context in grid):
        return
    if not all(case(variant, batch, context, "graph") for variant, batch, context in grid):
        return
    all(case(variant, 1, context, "eager") for context in contexts for variant in models)


def decode_step(model: K3ForCausalLM, cache: K3Cache, graphed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """tokens [N, 1] -> next-token logits [N, V], continuing `cache`: replayed from a CUDA graph,
    or the model's eager forward."""
    return CUDAGraphDecoder(model, cache).step if graphed else (lambda t: model(t, cache=cache)[:, -1])


@torch.no_grad()
def _decode_ms(model: K3ForCausalLM, batch: int, context: int, device, dtype, smoke: bool, graphed: bool) -> float:
    """Milliseconds per greedy decode step (one token per sequence, no host sync), timed over
    DECODE_STEPS_PER_CALL consecutive steps, with or without CUDA-graph replay."""
    cache = random_cache(model.config, batch, context, device, dtype, capacity=context + DECODE_STEPS_PER_CALL)
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    step = decode_step(model, cache, graphed)
    mla = [s for s in cache.layers if isinstance(s, MLAState)]

    def steps() -> None:
        for _ in range(DECODE_STEPS_PER_CALL):
            tokens.copy_(step(tokens).argmax(-1, keepdim=True))
        cache.lengths.fill_(context)  # back to the measured context (rows past it are overwritten)
        for state in mla:
            state.lengths.fill_(context)

    return median_ms(steps, device, warmup_ms=1, rep_ms=300 if not smoke else 50) / DECODE_STEPS_PER_CALL


# ----------------------------------------------------------------------------- (4) routed experts
def bench_moe(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float) -> None:
    cfg = SHAPE.load(smoke)
    bank = RoutedExperts(cfg, cfg.moe_hidden_size, cfg.moe_intermediate_size)
    bank.reset_parameters()
    bank = bank.to(device, torch.bfloat16)
    k = cfg.num_experts_per_token
    for tokens, backward in (((256, True), (8, False)) if smoke else ((32768, True), (64, False))):
        x = torch.randn(tokens, cfg.moe_hidden_size, device=device, dtype=torch.bfloat16, requires_grad=backward)
        idx = torch.rand(tokens, cfg.num_experts, device=device).topk(k, dim=-1).indices
        weights = torch.softmax(torch.randn(tokens, k, device=device), dim=-1)
        flops = 2 * tokens * k * 3 * cfg.moe_hidden_size * cfg.moe_intermediate_size * (3 if backward else 1)
        if backward:
            fn = _fwd_bwd(lambda x=x, weights=weights, idx=idx: bank(x, weights, idx), [x, bank.w1, bank.w3, bank.w2])
        else:
            def fn(x=x, weights=weights, idx=idx):
                with torch.no_grad():
                    bank(x, weights, idx)
        chosen = "grouped_mm" if grouped_mm_available(x) else "per-expert loop"
        for label, forced in ((f"dispatch: {chosen}", False), ("forced per-expert loop", True)):
            name = f"experts {'fwd+bwd' if backward else 'fwd'} N{tokens} k{k} E{cfg.num_experts} [{label}]"
            if time.monotonic() + 10 > deadline:
                _skip(record, "moe", name, "time budget")
                continue
            with per_expert_loop() if forced else contextlib.nullcontext():
                ms = median_ms(fn, device, warmup_ms=5, rep_ms=100)
            _say(record, {"kind": "bench", "bench": "moe", "name": name, "status": "ok", "ms": ms,
                          "tflops": flops / (ms * 1e-3) / 1e12})


# ----------------------------------------------------------------------------- (5) serving engine vs HF
def bench_serve(device: torch.device, smoke: bool, ceilings: dict, record: Record, deadline: float) -> None:
    """bench.serve's comparison at GPU size: the k3 engine vs HF `generate` on the same random
    Kimi-Linear weights, bf16, after a warm-up run of each."""
    from bench.serve import run

    size, prompts, prompt_len, new_tokens, vocab = ("tiny", 4, 16, 8, 4096) if smoke else ("gpu", 32, 512, 64, 32000)
    # then a mixed workload at the same concurrency, where continuous batching counts (HF in static batches)
    mixed = {"requests": 6, "prompt_lens": (4, 24), "new_tokens": (2, 8)} if smoke else \
        {"requests": 96, "prompt_lens": (32, 512), "new_tokens": (8, 128)}
    results = run(size, device, prompts, prompt_len, new_tokens, vocab,
                  mixed=dict(mixed, concurrency=prompts, budget=prompts * prompt_len))
    for workload, result in results:  # each recorded when done: the mixed one may not fit the deadline
        name = (f"Kimi-Linear '{size}', {prompts} prompts x {prompt_len} tokens, {new_tokens} new"
                if workload == "uniform" else f"Kimi-Linear '{size}', mixed")
        _say(record, {"kind": "bench", "bench": "serve", "workload": workload, "status": "ok", "size": size,
                      "name": name, **result})


BENCHES = {"train": bench_train, "kda": bench_kda, "decode": bench_decode, "moe": bench_moe, "serve": bench_serve}


# ----------------------------------------------------------------------------- the tables printed last
def _fmt(x, spec: str = ".3g") -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)  # batch sizes, contexts: exact
    return format(x, spec) if isinstance(x, float) else str(x if x is not None else "")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows])


def tables(entries: list[dict]) -> list[str]:
    """One table per bench that has results, then a table of what was skipped or failed."""
    ok = {b: [e for e in entries if e.get("bench") == b and e.get("status") == "ok"] for b in BENCHES}
    out = []
    if ok["train"]:
        out += ["### Training step (bf16 autocast, AdamW)", _table(
            ["config", "ms/step", "tokens/s", "TFLOP/s", "MFU (measured ceiling)", "MFU (989 datasheet)", "peak GB",
             "note"],
            [[e["name"], e["ms_per_step"], e["tokens_per_s"], e["tflops"], f"{e['mfu_measured_ceiling']:.1%}",
              f"{e['mfu_datasheet']:.1%}", e.get("peak_mem_gb"), e.get("note", "")] for e in ok["train"]])]
    if timed := [e for e in ok["kda"] if "ms_fwd_bwd" in e]:
        out += ["### KDA vs attention, one layer / op, fwd+bwd, bf16, batch 1",
                _table(["case", "ms", "TFLOP/s"], [[e["name"], e["ms_fwd_bwd"], e.get("tflops", "")] for e in timed])]
        ratios = [f"{e['name']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in e.items() if isinstance(v, float))
                  for e in ok["kda"] if e["name"].startswith(("ratio", "speed"))]
        out.append("\n".join(ratios + [f"{e['name']}: {e['usable']}" for e in ok["kda"] if "usable" in e]))
    if dec := ok["decode"]:
        # the hybrid's advantage: its tokens/s over the all-MLA variant's, same batch, context, mode
        mla = {(e["batch"], e["context"], e["mode"]): e["tokens_per_s"] for e in dec if e["variant"] == "all-MLA"}
        out += ["### Decode (bf16, absorbed MLA, one token per sequence per step)", _table(
            ["variant", "mode", "batch", "context", "ms/step", "tokens/s", "bandwidth-bound tokens/s",
             "fraction of bound", "hybrid / all-MLA"],
            [[e["variant"], e["mode"], e["batch"], e["context"], e["ms_per_step"], e["tokens_per_s"],
              e["bound_tokens_per_s"], f"{e['fraction_of_bound']:.1%}",
              f"{e['tokens_per_s'] / mla[key]:.2f}x" if e["variant"] == "hybrid" and (
                  key := (e["batch"], e["context"], e["mode"])) in mla else ""] for e in dec])]
    if serve := [e for e in ok["serve"] if e["workload"] == "uniform"]:
        rows = [[e["name"], e["dtype"], f"k3 engine, {label}", e["hf_tokens_per_s"], e[f"k3_{mode}_tokens_per_s"],
                 f"{e[f'k3_{mode}_throughput_ratio']:.2f}x", e["hf_ttft_s"], e[f"k3_{mode}_ttft_s"],
                 f"{e[f'k3_{mode}_agreement_with_hf']:.1%}"]
                for e in serve for mode, (label, _, _) in K3_MODES.items() if f"k3_{mode}_tokens_per_s" in e]
        out += ["### Serving engine vs HF transformers generate (greedy, same weights)", _table(
            ["workload", "dtype", "engine", "HF tokens/s", "k3 tokens/s", "k3 / HF", "HF TTFT s", "k3 TTFT s",
             "greedy agreement with HF"], rows)]
        out.append("\n".join([f"{e['name']}: prefill logits vs HF fp32 (same device): HF {e['dtype']} "
                              f"{e['hf_prefill_rel_err']:.2e}, k3 {e['dtype']} {e['k3_prefill_rel_err']:.2e}"
                              + agreement_summary(e) for e in serve]
                             + [mixed_line(e) for e in ok["serve"] if e["workload"] == "mixed"]))
    if ok["moe"]:
        out += ["### Routed experts (bf16)",
                _table(["case", "ms", "TFLOP/s"], [[e["name"], e["ms"], e["tflops"]] for e in ok["moe"]])]
    if not_done := [e for e in entries if e.get("status") != "ok"]:
        out += ["### Not measured", _table(["bench", "name", "status", "note"],
                                           [[e["bench"], e["name"], e["status"], e.get("note", "")] for e in not_done])]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma list of {', '.join(BENCHES)}")
    parser.add_argument("--seconds", type=float, default=math.inf,
                        help="wall-clock budget from the start: sizes that would not finish inside it are skipped")
    parser.add_argument("--jsonl", type=Path, help="append every result to this file as a JSON line, as it comes")
    parser.add_argument("--config", default=SHAPE.config,
                        help="model of train, kda, decode and moe: a preset or config.json (default k3-1b)")
    parser.add_argument("--layers", type=int, help="cut the model to this many layers (3:1 KDA:MLA kept)")
    parser.add_argument("--batches", default=",".join(map(str, SHAPE.batches)), help="decode batch sizes")
    args = parser.parse_args(argv)
    try:
        SHAPE.config, SHAPE.layers = args.config, args.layers
        SHAPE.batches = tuple(int(b) for b in args.batches.split(","))
        if args.layers is not None and args.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {args.layers}")
        SHAPE.load(smoke=False)
    except (ValueError, OSError) as exc:
        parser.error(f"--config/--layers/--batches: {exc}")
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := [name for name in only if name not in BENCHES]:
        parser.error(f"--only: unknown {unknown}; choose from {', '.join(BENCHES)}")
    deadline = time.monotonic() + args.seconds
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    ceilings = ceilings_module.measure(device, args.smoke)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(ceilings_module.table(ceilings, device_name), flush=True)
    entries: list[dict] = []

    def record(entry: dict) -> None:
        entries.append(entry)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")

    for name in only:
        BENCHES[name](device, args.smoke, ceilings, record, deadline)
    print("\n\n".join(["", ceilings_module.table(ceilings, device_name), *tables(entries)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
