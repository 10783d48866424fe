"""The device's two ceilings, measured in the same run as the benches, and the one timing method
every GPU bench uses (/work/.library/device/METHOD.md: datasheet rates are leads; measure a large
bf16 matrix product and a large device-to-device copy on random data, median of repeats).

    python -m bench.ceilings [--smoke]

- bf16 matmul TFLOP/s: 2 n^3 / t for an n x n x n product (n = 8192 on GPU);
- copy GB/s: (bytes read + bytes written) / t for one large device-to-device copy (2 GiB on GPU).
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.utils.benchmark as torch_benchmark

# NVIDIA H200 SXM datasheet (dense, no sparsity); leads only, MFU is also given against the measured ceiling.
H200_BF16_DENSE_TFLOPS = 989.0
H200_HBM_GBPS = 4800.0


def median_ms(fn, device: torch.device, *, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median wall time of `fn()` in milliseconds, after a warm-up call (JIT, autotuning, handles).

    CUDA: triton's `do_bench` (CUDA events around each call, L2 flushed between calls, median).
    CPU: torch.utils.benchmark's blocked autorange (median over blocks)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up outside the measurement, as do_bench does
    timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=rep_ms / 1e3).median * 1e3


def matmul_tflops(device: torch.device, n: int) -> float:
    """bf16 n x n x n product on random data (zeros run faster on Hopper, METHOD.md)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.mm(a, b, out=out), device, warmup_ms=50, rep_ms=300)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, nbytes: int) -> float:
    """One device-to-device copy of `nbytes` random bytes; counts bytes read plus bytes written."""
    src = torch.randint(0, 256, (nbytes,), device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup_ms=50, rep_ms=300)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure(device: torch.device, smoke: bool) -> dict:
    n, nbytes = (256, 1 << 24) if smoke else (8192, 1 << 31)
    return {
        "matmul_bf16_tflops": matmul_tflops(device, n),
        "copy_gbps": copy_gbps(device, nbytes),
        "matmul_n": n,
        "copy_bytes": nbytes,
        "datasheet_bf16_tflops": H200_BF16_DENSE_TFLOPS,
        "datasheet_hbm_gbps": H200_HBM_GBPS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU is fine)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    c = measure(device, args.smoke)
    print(table(c, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"))
    return 0


def table(c: dict, device_name: str) -> str:
    return "\n".join([
        f"| ceiling on {device_name} | measured | H200 datasheet |", "|---|---|---|",
        (f"| bf16 matmul, n={c['matmul_n']} (TFLOP/s) | {c['matmul_bf16_tflops']:.1f} "
        f"| {c['datasheet_bf16_tflops']:.0f} |"),
        (f"| device copy, {c['copy_bytes'] >> 20} MiB, read+write (GB/s) | {c['copy_gbps']:.1f} "
        f"| {c['datasheet_hbm_gbps']:.0f} |")])


if __name__ == "__main__":
    raise SystemExit(main())
