"""How precisely fla's bf16 KDA returns the gate parameters' gradients, seed by seed (issue #5).

    python bench/kda_gate_precision.py [--seeds 6] [--loss both|output|state]

bench/gpu_checks.py compares every gradient of the KDA op at one seed. There dA_log of Kimi
Linear's softplus gate missed the 1e-2 bar (1.06e-2, run 11) while the per-token raw-gate gradient
it is summed from was within 4e-3. This measures, at the checks' shapes (B 2, T 1000, 8 heads of
128) and for both gate forms, over several seeds: the output, the raw-gate gradient, dA_log and
dt_bias against the fp32 torch chunk path on the same values upcast; with the gate activated in
fla's kernel (the layer's path) and by torch before fla (no in-kernel gate), so that an error in
fla's gate kernel would show as a difference between the two. `--loss` picks what the gradients
are of: the output and the final state together (as the checks), or either alone, to tell which
path's error adds up in the sums. CUDA with fla only. Prints a table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3.ops.kda import DecayGate, activate_gate, kda  # noqa: E402
from tests.conftest import rel_err  # noqa: E402
from tests.test_kda_ops import make_gate, make_inputs  # noqa: E402

B, T, H, K = 2, 1000, 8, 128
PATHS = {"reference": ("chunk", True), "fla, gate in-kernel": ("fla", True), "fla, gate by torch": ("fla", False)}
LOSSES = {"both": (1.0, 1.0), "output": (1.0, 0.0), "state": (0.0, 1.0)}  # weights of the o and final-state terms


def gradients(leaves: list[torch.Tensor], impl: str, in_kernel: bool, lower_bound, do, ds, loss: str):
    """Output and gradients of (q, k, v, raw gate, beta, h0, A_log, dt_bias)."""
    gate = DecayGate(leaves[6], leaves[7], lower_bound)
    q, k, v, raw, beta, h0 = leaves[:6]
    if in_kernel:
        o, s = kda(q, k, v, raw, beta, initial_state=h0, output_final_state=True, impl=impl, gate=gate)
    else:
        o, s = kda(q, k, v, activate_gate(raw, gate), beta, initial_state=h0, output_final_state=True, impl=impl)
    w_o, w_s = LOSSES[loss]
    return o, torch.autograd.grad(w_o * (o.float() * do).sum() + w_s * (s * ds).sum(), leaves)


def measure(form: str, seed: int, loss: str) -> dict[str, tuple[float, ...]]:
    torch.manual_seed(seed)
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, K, form)
    raw, gate = make_gate(B, T, H, K, form)
    keep_fp32 = (3, 5, 6, 7)  # the raw gate, the state and the gate parameters stay fp32, as the layer passes them
    inputs = [t.cuda() if i in keep_fp32 else t.cuda().bfloat16()
              for i, t in enumerate((q, k, v, raw, beta, h0, gate.A_log, gate.dt_bias))]
    do, ds = torch.randn(B, T, H, K, device="cuda"), torch.randn(B, H, K, K, device="cuda")
    results = {}
    for path, (impl, in_kernel) in PATHS.items():
        dtype = torch.float32 if path == "reference" else None
        leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in inputs]
        results[path] = gradients(leaves, impl, in_kernel, gate.lower_bound, do, ds, loss)
    ref_o, ref_g = results.pop("reference")
    return {path: (rel_err(ref_o.float().cpu(), o.float().cpu()),
                   *(rel_err(ref_g[i].cpu(), g[i].float().cpu()) for i in (3, 6, 7)))
            for path, (o, g) in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--loss", choices=tuple(LOSSES), default="both", help="what the gradients are of")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA and fla-core with triton")
    rows = [(form, seed, path, errs) for form in ("softplus", "lb") for seed in range(args.seeds)
            for path, errs in measure(form, seed, args.loss).items()]
    print(f"gradients of: {args.loss} (--loss)")
    print(f"{'gate':9} {'seed':>4} {'path':20} {'o':>9} {'draw gate':>9} {'dA_log':>9} {'ddt_bias':>9} "
          f"{'dA_log/draw':>11}")
    for form, seed, path, (o, draw, d_a, d_bias) in rows:
        print(f"{form:9} {seed:>4} {path:20} {o:9.2e} {draw:9.2e} {d_a:9.2e} {d_bias:9.2e} {d_a / draw:11.2f}")


if __name__ == "__main__":
    main()
