"""Kimi Delta Attention ops (DESIGN §3): one entry point, three interchangeable backends.

    kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, impl, chunk_size,
        update_state_in_place, normalize_qk, gate)

Shapes and layouts in `k3.ops.kda.inputs`. Backends, all computing the same function:
- "recurrent": token-by-token fp32 reference (`reference.py`); the CPU decode path (T == 1).
- "chunk":     chunkwise parallel plain torch (`chunk.py`); the CPU training/prefill path. A packed
               batch's one-token sequences run the recurrent step instead (`decode_rows.py`).
- "fla":       fla's Triton kernels on CUDA (`fla_backend.py`).
- "segmented": in-device sequence parallelism (`segmented.py`): long sequences cut into `segments`
               pieces run side by side through the device's chunked kernel (fla on CUDA, chunk on
               CPU) and joined exactly; forward only.
"auto" picks fla for half-precision values (bf16, fp16) on CUDA when it imports, else recurrent
when every sequence is one token long, else chunk; on fla it would take "segmented" where the
measured rule (`segmented.auto_segments`) finds it faster (no gradients, few sequences x heads, many
tokens; on an H100 no length was), and logs each choice once. fp32 stays on the torch
paths on CUDA too: Triton's fp32 `tl.dot` rounds operands to TF32, so fla's kernels on fp32 inputs
land 5e-4..3e-3 from the fp32 reference (on an H200; docs/LOG.md), while torch's fp32 matmuls are
IEEE (torch leaves `allow_tf32` off). fp32 is the precision of references and checks; speed comes
with bf16.
`update_state_in_place=True` (forward-only decode) writes the final state into `initial_state` and
returns that same tensor: the state keeps its address, as CUDA-graph replay needs, and the fla
decode kernel writes it directly instead of allocating and copying.
`normalize_qk=True` takes q and k before their L2 norm and normalizes them first: inside fla's
kernels (the same formula and eps, in fp32, saving the fp32 copies of q and k and their passes
through memory), in fp32 on the torch paths.
`gate=DecayGate(...)` takes g before its activation (the raw gate projections, `k3.ops.kda.gate`)
and activates it: inside fla's kernels, with `activate_gate` on the torch paths.
In host-free mode (k3.ops.host_free) nothing reads the lengths on the host on CUDA: "auto" takes
fla whatever the dtype (fp32 too, at TF32 rounding), never "segmented", and fla builds its chunk
list on the device (`use_graph`, fla_backend.py); a torch backend on CUDA is refused there. On
the CPU (never captured) "auto" takes chunk, which still reads the lengths, and handles the
zero-length tail documents as any other. Initial and final states work there as outside the mode
(one per entry of `cu_seqlens`; a zero-length document's state passes through unchanged).
"""
from __future__ import annotations

import functools
import logging

import torch

from k3.ops import batch_invariant, fla_kernels, host_free
from k3.ops.kda import fla_backend
from k3.ops.kda.chunk import kda_chunk
from k3.ops.kda.decode_rows import kda_split_decode_rows
from k3.ops.kda.gate import DecayGate, activate_gate
from k3.ops.kda.inputs import l2_normalize
from k3.ops.kda.reference import kda_recurrent
from k3.ops.kda.segmented import auto_segments, kda_segmented
from k3.ops.varlen import longest_sequence

logger = logging.getLogger(__name__)

IMPLS = ("auto", "chunk", "recurrent", "fla", "segmented")


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
    chunk_size: int = 64,
    update_state_in_place: bool = False,
    normalize_qk: bool = False,
    gate: DecayGate | None = None,
    sequential: bool = False,
    segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None). `sequential`:
    token-by-token arithmetic on every backend (torch: the recurrent reference; fla: its fused
    recurrent kernel, packed rows included), the decode step's own, so a replayed state equals the
    one a decode step would have reached (k3.ops.kda.replay). `segments`: pieces per sequence on the
    segmented path (None: the measured rule's choice under "auto", 8 under "segmented")."""
    if impl not in IMPLS:
        raise ValueError(f"kda: impl must be one of {IMPLS}, got {impl!r}")
    if update_state_in_place and (initial_state is None or not output_final_state
                                  or initial_state.dtype != torch.float32 or not initial_state.is_contiguous()):
        raise ValueError("kda: update_state_in_place needs output_final_state=True and a contiguous fp32 "
                         "initial_state to write into")
    sequential = sequential or batch_invariant.enabled()  # every token as a decode step computes it
    if host_free.active():
        impl = _host_free_impl(impl, q)
    if impl == "auto":
        impl = _auto_impl(q, v, cu_seqlens)
        if impl == "fla" and not (sequential or update_state_in_place or _needs_grad(q, k, v, g, beta, gate)):
            tokens, sequences = q.shape[0] * q.shape[1], _sequences(q, cu_seqlens)
            segments = segments or auto_segments(tokens, sequences, q.shape[2], q.device)
            if segments > 1:
                impl = "segmented"
                if not torch.compiler.is_compiling():
                    _announce(impl, q.device.type, v.dtype)
    if impl == "segmented" and (sequential or _needs_grad(q, k, v, g, beta, gate)):
        raise ValueError("kda: impl 'segmented' is forward-only and not token-by-token; use 'fla' or 'chunk'")
    if sequential and impl == "chunk":
        impl = "recurrent"
        if not torch.compiler.is_compiling():  # logging inside a traced region would break the graph
            _announce(impl, q.device.type, v.dtype)
    common = {"scale": scale, "initial_state": initial_state, "output_final_state": output_final_state,
                  "cu_seqlens": cu_seqlens}
    in_kernel = impl == "fla" or (impl == "segmented" and _fla_segments(q, v))  # fla normalizes and activates
    if not in_kernel and normalize_qk:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if not in_kernel and gate is not None:
        g = activate_gate(g, gate)
    floor = None if gate is None else gate.lower_bound  # every activated g lies above it: chunk's bound
    if impl == "segmented":
        run = _fla_segment_kernel(scale, chunk_size, normalize_qk, gate) if in_kernel else \
            _torch_segment_kernel(scale, chunk_size, floor)
        o, final_state = kda_segmented(run,
                                       q, k, v, g, beta, segments=segments or 8, initial_state=initial_state,
                                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                       align=chunk_size)
    elif impl == "fla":
        o, final_state = fla_backend.kda_fla(q, k, v, g, beta, **common, chunk_size=chunk_size,
                                             update_state_in_place=update_state_in_place,
                                             normalize_qk=normalize_qk, gate=gate, sequential=sequential)
    elif impl == "recurrent" and sequential and cu_seqlens is not None:  # a replay: all rows as one batch
        o, final_state = kda_split_decode_rows(q, k, v, g, beta, **common, short_below=q.shape[1])
    elif impl == "recurrent":
        o, final_state = kda_recurrent(q, k, v, g, beta, **common)
    elif cu_seqlens is not None:  # a serving step's decode rows must not be padded to a chunk each
        o, final_state = kda_split_decode_rows(q, k, v, g, beta, **common, chunk_size=chunk_size, decay_floor=floor)
    else:
        o, final_state = kda_chunk(q, k, v, g, beta, **common, chunk_size=chunk_size, decay_floor=floor)
    if update_state_in_place and final_state is not initial_state:  # fla's decode kernel wrote it already
        final_state = initial_state.copy_(final_state)
    return o, final_state


HALF_DTYPES = (torch.bfloat16, torch.float16)


def _host_free_impl(impl: str, q: torch.Tensor) -> str:
    if not q.is_cuda:
        return "chunk" if impl == "auto" else impl  # "auto" would read the longest length to pick recurrent
    if impl not in ("auto", "fla") or not fla_kernels.available():
        raise ValueError(f"kda: host-free mode on CUDA needs fla-core with triton and impl 'auto' or 'fla', "
                         f"got impl {impl!r}")
    return "fla"


def _needs_grad(*tensors) -> bool:
    gate = tensors[-1]
    leaves = [*tensors[:-1], *((gate.A_log, gate.dt_bias) if gate is not None else ())]
    return torch.is_grad_enabled() and any(t.requires_grad for t in leaves)


def _sequences(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1  # from shapes: no device sync


def _fla_segments(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.is_cuda and v.dtype in HALF_DTYPES and fla_kernels.available()


def _fla_segment_kernel(scale, chunk_size, normalize_qk, gate):
    def run(q, k, v, g, beta, state, cu):
        return fla_backend.kda_fla(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                   cu_seqlens=cu, chunk_size=chunk_size, normalize_qk=normalize_qk, gate=gate)
    return run


def _torch_segment_kernel(scale, chunk_size, floor):
    def run(q, k, v, g, beta, state, cu):
        return kda_chunk(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                         cu_seqlens=cu, chunk_size=chunk_size, decay_floor=floor)
    return run


def _auto_impl(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None) -> str:
    # v's dtype is the activation dtype (q/k may arrive in fp32, normalized by the caller)
    if q.is_cuda and v.dtype in HALF_DTYPES and fla_kernels.available():
        return "fla"
    return "recurrent" if longest_sequence(q.shape[1], cu_seqlens) == 1 else "chunk"


@functools.cache
def _announce(impl: str, device: str, dtype: torch.dtype) -> None:
    logger.info("ops.kda: %s (%s, %s)", impl, device, dtype)


__all__ = ["IMPLS", "DecayGate", "activate_gate", "kda", "kda_chunk", "kda_recurrent"]
