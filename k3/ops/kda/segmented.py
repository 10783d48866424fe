"""In-device sequence parallelism for KDA prefill (K3 report §7.1, DESIGN §3): one long sequence
split into segments that run side by side, joined exactly by the affine algebra of the state.

Per head, a token maps the state S [K, V] affinely: S <- A_t S + beta_t k_t v_t^T with
A_t = (I - beta_t k_t k_t^T) Diag(exp g_t) (k3.ops.kda.reference). Over a segment s,

    S_end = M_s S_in + S~_s        M_s = A_last ... A_first  [K, K],  S~_s = the state written from zero
    o_t   = o~_t + p_t S_in        p_t = (scale q_t)^T M_{<=t}  [K],   o~_t = the output from a zero state

The state's columns evolve independently under the same A_t, so ONE pass of the ordinary chunked
kernel over every segment at once (segments as independent rows of a packed batch) yields all of
it: values augmented with K zero columns, v' = [v | 0], from the state [S_0 | I] gives final states
[S~_s | M_s] and outputs [o~_t | p_t]. The segments' pairs are then composed in order (a scan over
segments, S_in of segment s+1 = M_s S_in + S~_s, tiny [K, K] x [K, V] matmuls), and every output
after a sequence's first segment is corrected by p_t S_in (one batched matmul). A sequence's first
segment starts from its real initial state, so its outputs and pair need no correction.

The augmented pass does (V + K) / V times the kernel's value-side work, in exchange for segments x
more independent rows: it pays where the ordinary kernel leaves most of the card idle (few
sequences x heads, long sequences: the state recurrence runs chunk after chunk per row). Forward
only: training keeps the ordinary kernel (k3.ops.kda's dispatcher never picks this with gradients).
`run` is any backend with initial states and packed rows (fla's `chunk_kda` on CUDA, `kda_chunk`
on CPU, where the tests check the algebra against the token-by-token reference).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from k3.ops.kda.inputs import check_kda_inputs
from k3.ops.varlen import seq_lengths

# run(q, k, v, g, beta, initial_state, cu_seqlens) -> (o, final_state): a chunked KDA backend
SegmentKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# The measured rule (bench/kda_segments.py, docs/BENCHMARKS.md): on an H100 at B = 1, H = 12, d = 128
# the segmented path was slower than fla's kernel alone at every length measured, 16K to 512K tokens
# with 8 to 64 segments (0.28x to 0.49x): the recurrence is only 37% of fla's time there, its
# parallel kernels the rest, and the augmented pass costs about what fla's whole op does
# (docs/LOG.md). So "auto" keeps fla (no crossover: None) until a cheaper pass exists; the
# segmented path runs where asked for (`impl="segmented"`).
FASTER_FROM_TOKENS: int | None = None  # shortest length where it measured faster; None: none found
MIN_SEGMENT = 2048  # shorter segments spend more on the pass's extra K columns than they save
ROWS_PER_SM = 4  # enough (row x segment) programs per SM to hide the recurrence's latency


def auto_segments(tokens: int, sequences: int, heads: int, device: torch.device) -> int:
    """Segments per sequence for the segmented path, from shapes alone (no device sync); 1 = don't."""
    if device.type != "cuda" or FASTER_FROM_TOKENS is None or tokens < FASTER_FROM_TOKENS:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = ROWS_PER_SM * sms // max(1, sequences * heads)
    return max(1, min(want, tokens // max(1, sequences) // MIN_SEGMENT))


def segment_bounds(lengths: list[int], segments: int, align: int = 64) -> list[tuple[int, int, int]]:
    """(sequence, start, end) of each segment, in packed order: every sequence cut into at most
    `segments` pieces of equal length, a multiple of `align` (the kernel's chunk), the last shorter."""
    if segments < 1:
        raise ValueError(f"kda segmented: segments must be >= 1, got {segments}")
    bounds, offset = [], 0
    for n, length in enumerate(lengths):
        piece = -(-max(length, 1) // segments)
        piece = -(-piece // align) * align
        for start in range(0, length, piece):
            bounds.append((n, offset + start, offset + min(start + piece, length)))
        offset += length
    return bounds


def kda_segmented(
    run: SegmentKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    segments: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    align: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None), as k3.ops.kda."""
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:  # a uniform batch is N sequences end to end
        lengths = [T] * B
        q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    else:
        lengths = seq_lengths(cu_seqlens)
    bounds = segment_bounds(lengths, segments, align)
    dev = q.device
    seq_of = torch.tensor([n for n, _, _ in bounds], device=dev, dtype=torch.long)
    starts = [s for _, s, _ in bounds]
    first = [i == 0 or bounds[i - 1][0] != n for i, (n, _, _) in enumerate(bounds)]
    seg_cu = torch.tensor([*starts, B * T if cu_seqlens is None else T], device=dev, dtype=torch.long)

    # one pass over all segments: values [v | 0], states [S_0 (first segments) or 0 | I]
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
    state0 = torch.zeros(len(bounds), H, K, V + K, device=dev, dtype=torch.float32)
    state0[..., V:] = torch.eye(K, device=dev)
    first_rows = torch.tensor([i for i, f in enumerate(first) if f], device=dev, dtype=torch.long)
    if initial_state is not None:
        state0[first_rows, :, :, :V] = initial_state.float()[seq_of[first_rows]]
    o_aug, f_aug = run(q, k, v_aug, g, beta, state0, seg_cu)
    o, p = o_aug[0, :, :, :V], o_aug[0, :, :, V:]
    local, transition = f_aug[..., :V], f_aug[..., V:]

    # the scan: each segment's true incoming state is its predecessor's true end (in segment order)
    incoming = torch.zeros(len(bounds), H, K, V, device=dev, dtype=torch.float32)
    ends = local.clone()  # a first segment started from its sequence's real state: already true
    for i in range(1, len(bounds)):
        if not first[i]:
            incoming[i] = ends[i - 1]
            ends[i] = torch.matmul(transition[i], ends[i - 1]) + local[i]

    o = _correct(o, p, incoming, bounds, first)
    o = o.reshape(B, T, H, V) if cu_seqlens is None else o.unsqueeze(0)
    if not output_final_state:
        return o, None
    final = initial_state.float().clone() if initial_state is not None else \
        torch.zeros(N, H, K, V, device=dev, dtype=torch.float32)  # an empty sequence keeps its state
    last_rows = [i for i in range(len(bounds)) if i + 1 == len(bounds) or first[i + 1]]
    final[seq_of[last_rows]] = ends[last_rows]
    return o, final


def _correct(o: torch.Tensor, p: torch.Tensor, incoming: torch.Tensor, bounds, first) -> torch.Tensor:
    """o_t += p_t S_in for the tokens of every segment after a sequence's first, in fp32."""
    rest = [i for i, f in enumerate(first) if not f]
    if not rest:
        return o
    T, H, V = o.shape
    width = max(bounds[i][2] - bounds[i][1] for i in rest)
    starts = torch.tensor([bounds[i][1] for i in rest], device=o.device)
    ends = torch.tensor([bounds[i][2] for i in rest], device=o.device)
    idx = starts[:, None] + torch.arange(width, device=o.device)
    idx = torch.where(idx < ends[:, None], idx, T)  # padding reads and writes a sink row past the end
    o_ext = torch.cat([o, o.new_zeros(1, H, V)])
    p_ext = torch.cat([p, p.new_zeros(1, H, p.shape[-1])])
    rows = p_ext[idx].float().transpose(1, 2)  # [segments, H, width, K]
    fix = torch.matmul(rows, incoming[rest]).transpose(1, 2)  # [segments, width, H, V]
    o_ext[idx] = (o_ext[idx].float() + fix).to(o.dtype)
    return o_ext[:T]
