"""KDA on CUDA through flash-linear-attention's Triton kernels (fla-core 0.6.0), imported lazily.

Same contract as the reference (`k3.ops.kda.inputs`), so the layer never knows which path ran.
fla 0.6.0 options chosen to compute exactly our reference math (checked against
fla/ops/kda/chunk.py and fused_recurrent.py of 0.6.0):
- the gate: with a `DecayGate`, `g` arrives raw and fla activates it in-kernel
  (`use_gate_in_kernel`, with `A_log` [H], `dt_bias` [H*K] and `lower_bound`: the same two forms as
  `k3.ops.kda.gate`); otherwise `g` arrives activated. A lower-bounded gate (in [lb, 0), lb >= -5 by
  config validation) also takes `safe_gate`, fla's M=16 TensorCore path for bounded gates; it
  is prefix-invariant (fla issue #1240: exactly 0) and accurate against the torch reference, both
  checked by the GPU tests (tests/ops/test_kda_fla.py). q/k's L2 norm runs in the kernels
  with `normalize_qk` (`use_qk_l2norm_in_kernel`: x / sqrt(sum x^2 + 1e-6) in fp32, our formula and
  eps); beta arrives post-sigmoid: `use_beta_sigmoid_in_kernel=False`.
- dtypes as fla's own layer hands them over: q/k in v's dtype; beta as it comes (the layer's fp32
  sigmoid; fla's in-kernel sigmoid also returns fp32); a raw gate in its own dtype, since fla's gate
  kernel activates it in fp32 and returns its gradient in that dtype (an fp32 copy of a bf16
  projection adds no precision, only a copy each way and twice the gate kernel's reads); an
  activated gate in fp32, its cumulative sums' precision.
- state layout: fla's default key-first [N, H, K, V] (`state_v_first=False`), fp32 as fla asserts.
- `cu_seqlens` is fla's (FlashAttention) convention, the same as ours.
- chunk_kda accepts chunk sizes 32 and 64 only; a smaller requested chunk runs at 64 (the chunk
  size changes rounding, not the math).
- decode (every sequence one token long, no gradient needed) uses fla's recurrent kernel, which is
  forward-only; everything else uses `chunk_kda`, which has autograd. With update_state_in_place
  the decode kernel reads and writes the caller's state tensor (`fused_recurrent_kda_fwd` with
  `inplace_final_state=True`: the public `fused_recurrent_kda` always allocates a new one); on the
  other paths k3.ops.kda copies the new state in, as it does for every backend.
- host-free mode (k3.ops.host_free), packed rows: `chunk_kda(use_graph=True, max_num_seqs=N)`,
  fla's fixed-shape chunk list built on the device, made for graph capture with zero-length tail
  documents (fla/ops/kda/chunk.py of 0.6.0). The recurrent kernel sizes its grid by N alone and
  needs no flag. Initial states come one per entry, [N_max, H, K, V], and final states leave the
  same way: fla's state kernel runs a zero-length document's loop zero times and stores its
  initial state as its final one (a captured serving prefill's padding keeps its state).
"""
from __future__ import annotations

import torch

from k3.ops import fla_kernels, host_free
from k3.ops.kda.gate import DecayGate
from k3.ops.kda.inputs import check_kda_inputs

FLA_CHUNK_SIZES = (32, 64)


def kda_fla(
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
    chunk_size: int = 64,
    update_state_in_place: bool = False,
    sequential: bool = False,
    normalize_qk: bool = False,
    gate: DecayGate | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not q.is_cuda:
        raise ValueError(f"kda impl 'fla' runs on CUDA tensors only, got device {q.device}")
    if not fla_kernels.available():
        raise RuntimeError("kda impl 'fla' needs fla-core with triton (pip install 'k3[cuda]'); "
                           "use impl='chunk' or 'auto' instead")
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)  # fail here, not inside a Triton launch

    q, k = q.to(v.dtype), k.to(v.dtype)
    if gate is None:
        g = g.float()
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    inputs = (q, k, v, g, beta, initial_state) + ((gate.A_log, gate.dt_bias) if gate is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs if t is not None)
    common = {"scale": scale, "initial_state": initial_state, "output_final_state": output_final_state,
                  "cu_seqlens": cu_seqlens, "use_qk_l2norm_in_kernel": normalize_qk}
    if gate is not None:
        common.update(use_gate_in_kernel=True, A_log=gate.A_log.float().reshape(-1),
                      dt_bias=gate.dt_bias.float(), lower_bound=gate.lower_bound)
    # Only a uniform [N, 1] batch takes the decode kernel; packed rows always run chunk_kda, which
    # handles one-token sequences too. Telling a packed batch of one-token rows apart would read the
    # lengths back to the host in every KDA layer of every packed step, and inside a compiled region
    # that read is a graph break. The engine sends decode-only steps as [N, 1].
    decode = cu_seqlens is None and q.shape[1] == 1 and not needs_grad
    if decode and update_state_in_place:
        # writes into initial_state (the caller's, as k3.ops.kda checked it is contiguous fp32);
        # the raw kernel entry skips fla's input_guard: hand it contiguous tensors
        o, state = fused_recurrent_kda_fwd(*(t.contiguous() for t in (q, k, v, g, beta)), **common,
                                           inplace_final_state=True)
    elif decode or (sequential and not needs_grad):  # token by token, packed rows too (a replay)
        o, state = fused_recurrent_kda(q, k, v, g, beta, **common)
    else:
        bounded = gate is not None and gate.lower_bound is not None
        if cu_seqlens is not None and host_free.active():  # the chunk list built on the device, fixed shape
            common.update(use_graph=True, max_num_seqs=cu_seqlens.numel() - 1)
        o, state = chunk_kda(q, k, v, g, beta, **common, use_beta_sigmoid_in_kernel=False, safe_gate=bounded,
                             state_v_first=False, chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64)
    return o, state if output_final_state else None
