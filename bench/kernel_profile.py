"""The tables the profiling scripts (bench.train_profile, bench.decode_profile,
bench.kda_layer_profile, bench.serve --profile) print from a torch.profiler run: GPU time per
kernel, per kind of kernel (which part of the model a kernel serves), and per aten op and input
shapes (which tensors the time goes to; needs `record_shapes=True`). A helper module, no script."""
from __future__ import annotations

from collections import defaultdict

import torch

# Kernel name fragments -> kind, matched case-insensitively, first match wins: what a reader needs
# to see where a step goes. Inductor's generated kernels (triton_poi_ / triton_red_ / triton_per_ /
# triton_tem_) come first, as their names list the fused ops ("..._to_copy_add_mean...").
KINDS = (
    ("fused (inductor) kernels", ("triton_poi", "triton_red", "triton_per", "triton_tem")),
    ("KDA (fla chunk / recurrent / conv / norm-gate kernels)",
     ("kda", "chunk_", "gated_delta", "fused_recurrent", "causal_conv", "wy_", "solve_tril", "layer_norm",
      "rms_norm", "l2norm")),
    ("attention (flash / SDPA)", ("flash", "fmha", "attention")),
    ("grouped GEMM (routed experts)", ("grouped",)),
    ("GEMM / GEMV (cuBLAS, nvjet, CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv", "dot_kernel")),
    ("optimizer (fused AdamW)", ("adam",)),
    ("sort / scatter / index (routing)", ("sort", "scatter", "index", "gather", "radix", "topk")),
    ("copies and casts", ("copy", "catarray")),
    ("reductions (norms, softmax, sums)", ("reduce", "softmax")),
    ("elementwise", ("elementwise",)),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lowered for p in parts)), "other")


def print_kernel_tables(prof: torch.profiler.profile, steps: int, title: str, top: int = 20) -> dict[str, float]:
    """A heading with the kernels' GPU time per step, the `top` largest kernels, then the kinds.
    Returns the GPU ms per step of each kind."""
    # GPU-side ranges of annotations ("## Call CompiledFxGraph ... ##" around each compiled graph,
    # "Optimizer.step#AdamW.step") span kernels that are listed themselves: counting them would count
    # those kernels twice. Kernel names never contain '#'.
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.key]
    if not kernels:
        print(f"\n### {title}: no CUDA kernels recorded")
        return {}
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[kind_of(e.key)] += e.self_device_time_total / steps / 1e3
    total_ms = sum(by_kind.values())
    print(f"\n### {title}: {total_ms:.3f} ms of kernels per step, "
          f"{sum(e.count for e in kernels) / steps:.0f} kernels per step")
    print(f"\n| kernel (largest {top}) | calls/step | CUDA ms/step |")
    print("|---|---|---|")
    for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        print(f"| {e.key[:100]} | {e.count / steps:.0f} | {e.self_device_time_total / steps / 1e3:.3f} |")
    print("\n| kind of kernel | CUDA ms/step | share |")
    print("|---|---|---|")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: kv[1], reverse=True):
        print(f"| {kind} | {ms:.3f} | {ms / total_ms:.0%} |")
    return dict(by_kind)


def print_op_table(prof: torch.profiler.profile, steps: int, top: int = 24) -> None:
    """The aten ops whose own kernels take the most GPU time, by op and input shapes: the shapes
    tell which tensors the time goes to (forward ops and the backward ops autograd runs alike)."""
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")
           and e.self_device_time_total > 0]
    print(f"\n| aten op (largest {top} by own GPU time) | input shapes | calls/step | CUDA ms/step |")
    print("|---|---|---|---|")
    for e in sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        shapes = ", ".join(str(s) for s in e.input_shapes if s)[:80]
        print(f"| {e.key} | {shapes} | {e.count / steps:.0f} | {e.self_device_time_total / steps / 1e3:.3f} |")
