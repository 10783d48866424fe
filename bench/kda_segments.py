"""In-device sequence parallelism for KDA prefill (k3.ops.kda.segmented) against fla's `chunk_kda`:
forward time of the KDA op at batch 1, bf16, K3's bounded gate in the kernel, by length and by
segment count, and where the segmented path's time goes.

    python -m bench.kda_segments [--heads 12] [--lengths 16384 65536 131072 524288] [--segments 2 4 8 16 32 64]

For each length: fla's time, the segmented path's time at each segment count (and the measured
rule's choice), the speed-up, and for the best count the time by phase: the augmented pass (fla's
kernel over all segments with K extra value columns), the rest (the scan over segments and the
output correction), and the alternative of re-running the segments from their true states (the
augmented pass for the pairs plus a second ordinary pass) instead of correcting outputs.
Times are `triton.testing.do_bench` medians (ms). CUDA with fla only.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from k3.ops.kda import DecayGate, fla_backend, kda
from k3.ops.kda.segmented import auto_segments, segment_bounds


def inputs(T: int, H: int, K: int):
    dev, bf16 = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf16)
    k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf16)
    v = torch.randn(1, T, H, K, device=dev, dtype=bf16)
    raw = torch.randn(1, T, H, K, device=dev, dtype=bf16)
    beta = torch.sigmoid(torch.randn(1, T, H, device=dev))
    gate = DecayGate(torch.empty(H, device=dev).uniform_(-1, 1), torch.empty(H * K, device=dev).uniform_(-1, 1), -5.0)
    return (q, k, v, raw, beta), {"gate": gate, "normalize_qk": True, "output_final_state": True,
                                  "initial_state": torch.randn(1, H, K, K, device=dev)}


def augmented_pass(args, kw, segments: int):
    """Only the segmented path's kernel pass, as it runs it (for the phase split)."""
    q, k, v, raw, beta = args
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    bounds = segment_bounds([T], segments)
    cu = torch.tensor([s for _, s, _ in bounds] + [T], device="cuda")
    v_aug = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
    state = torch.zeros(len(bounds), H, K, 2 * K, device="cuda")
    plain_state = torch.zeros(len(bounds), H, K, K, device="cuda")

    def aug():
        return fla_backend.kda_fla(q, k, v_aug, raw, beta, initial_state=state, output_final_state=True,
                                   cu_seqlens=cu, normalize_qk=True, gate=kw["gate"])

    def plain():
        return fla_backend.kda_fla(q, k, v, raw, beta, initial_state=plain_state, output_final_state=True,
                                   cu_seqlens=cu, normalize_qk=True, gate=kw["gate"])
    return aug, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 131072, 524288])
    ap.add_argument("--segments", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--profile", type=int, metavar="S", help="instead: kernel tables of fla and of S segments "
                    "at the first length")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_segments: error: needs CUDA and fla-core with triton")
    H, K = args.heads, args.head_dim
    print(f"# {torch.cuda.get_device_name()}, B=1, H={H}, d={K}, bf16, bounded gate, torch {torch.__version__}")
    print("| T | fla ms | best S | segmented ms | speed-up | rule's S | rule ms | pass ms | scan+correct ms | re-run alt ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if args.profile:
        return profile(args.lengths[0], H, K, args.profile)
    for T in args.lengths:
        print(measure(T, H, K, args.segments), flush=True)
        torch.cuda.empty_cache()


@torch.no_grad()
def measure(T: int, H: int, K: int, counts: list[int]) -> str:
    from triton.testing import do_bench

    torch.manual_seed(0)
    a, kw = inputs(T, H, K)
    fla_ms = do_bench(lambda: kda(*a, impl="fla", **kw))
    times = {S: do_bench(lambda S=S: kda(*a, impl="segmented", segments=S, **kw)) for S in counts}
    best = min(times, key=times.get)
    rule = auto_segments(T, 1, H, torch.device("cuda"))
    if rule > 1 and rule not in times:
        times[rule] = do_bench(lambda: kda(*a, impl="segmented", segments=rule, **kw))
    rule_ms = times[rule] if rule > 1 else fla_ms
    aug, plain = augmented_pass(a, kw, best)
    pass_ms, plain_ms = do_bench(aug), do_bench(plain)
    return (f"| {T} | {fla_ms:.2f} | {best} | {times[best]:.2f} | {fla_ms / times[best]:.2f}x | {rule} | "
            f"{rule_ms:.2f} | {pass_ms:.2f} | {times[best] - pass_ms:.2f} | {pass_ms + plain_ms:.2f} |\n"
            "  by S: " + ", ".join(f"{S}: {ms:.2f}" for S, ms in sorted(times.items())))


@torch.no_grad()
def profile(T: int, H: int, K: int, segments: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from bench.kernel_profile import print_kernel_tables

    a, kw = inputs(T, H, K)
    for title, fn in (("fla chunk_kda", lambda: kda(*a, impl="fla", **kw)),
                      (f"segmented, S={segments}", lambda: kda(*a, impl="segmented", segments=segments, **kw))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print_kernel_tables(prof, 3, f"{title}, T={T}, H={H}", top=14)


if __name__ == "__main__":
    main()
