"""How precisely fla's bf16 KDA returns the gate parameters' gradients, seed by seed.

    python -m bench.kda_gate_precision [--seeds 6] [--loss both|output|state]

A_log [H] and dt_bias [H*K] act on every token's gate, so their gradients are sums over tokens
(and, for A_log, keys) of the per-token raw-gate gradient: terms of both signs that largely cancel,
so their relative error can exceed the per-token one and swings with the seed. This measures, at
B 2, T 1000, 8 heads of 128 and for both gate forms, over several seeds: the output, the raw-gate
gradient, dA_log and ddt_bias against the fp32 torch chunk path on the same values upcast; with the
gate activated in fla's kernel (the layer's path) and by torch before fla (no in-kernel gate), so
that an error in fla's gate kernel would show as a difference between the two. `--loss` picks what
the gradients are of: the output and the final state together, or either alone, to tell which
path's error adds up in the sums. Each gate form's last rows pool the seeds: the same RMSE ratio
over the 8 heads of every seed (tests/ops/test_kda_fla.py bounds dA_log so). CUDA with fla only.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.common import gated_kda_grads, kda_gate_case, rel_err
from k3.ops.kda import DecayGate, activate_gate, kda

LOSSES = {"both": (1.0, 1.0), "output": (1.0, 0.0), "state": (0.0, 1.0)}  # weights of the o and final-state terms
QUANTITIES = ("o", "draw gate", "dA_log", "ddt_bias")


def torch_gate_grads(leaves: list[torch.Tensor], lower_bound, do, ds, weights):
    """fla with the gate activated by torch first (no in-kernel gate): o and every leaf's gradient."""
    o, s = kda(*leaves[:3], activate_gate(leaves[3], DecayGate(*leaves[6:], lower_bound)), leaves[4],
               initial_state=leaves[5], output_final_state=True, impl="fla")
    return o, s, *torch.autograd.grad(weights[0] * (o.float() * do).sum() + weights[1] * (s * ds).sum(), leaves)


PATHS = {"fla, gate in-kernel": partial(gated_kda_grads, "fla"), "fla, gate by torch": torch_gate_grads}


def measure(form: str, seed: int, loss: str, paths=tuple(PATHS)) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """For each of `paths`, (reference, fla) pairs of o, the raw-gate gradient, dA_log and ddt_bias,
    on the CPU, against the fp32 torch chunk path on the same values upcast."""
    ref, out, lower_bound, do, ds = kda_gate_case(form, seed)
    weights = LOSSES[loss]
    results = {path: PATHS[path]([t.detach().clone().requires_grad_() for t in out], lower_bound, do, ds, weights)
               for path in paths}
    expected = gated_kda_grads("chunk", ref, lower_bound, do, ds, weights)
    picks = (0, 5, 8, 9)  # o; after the state and dq, dk, dv: the raw gate's gradient; A_log's, dt_bias's
    return {path: [(expected[i].float().cpu(), got[i].float().cpu()) for i in picks] for path, got in results.items()}


def row(form: str, seed: str, path: str, errs: list[float]) -> str:
    return f"{form:9} {seed:>6} {path:20} " + " ".join(f"{e:9.2e}" for e in errs) + f" {errs[2] / errs[1]:11.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--loss", choices=tuple(LOSSES), default="both", help="what the gradients are of")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kda_gate_precision: error: needs CUDA and fla-core with triton")
    print(f"gradients of: {args.loss} (--loss); rel = RMSE(ref - fla) / RMSE(ref)")
    print(f"{'gate':9} {'seed':>6} {'path':20} " + " ".join(f"{q:>9}" for q in QUANTITIES) + f" {'dA_log/draw':>11}")
    for form in ("softplus", "lb"):
        pairs: dict[str, list] = {}
        for seed in range(args.seeds):
            for path, pair in measure(form, seed, args.loss).items():
                pairs.setdefault(path, []).append(pair)
                print(row(form, str(seed), path, [rel_err(r, o) for r, o in pair]))
        for path, per_seed in pairs.items():
            pooled = [rel_err(torch.cat([p[i][0].flatten() for p in per_seed]),
                              torch.cat([p[i][1].flatten() for p in per_seed])) for i in range(len(QUANTITIES))]
            print(row(form, "pooled", path, pooled))


if __name__ == "__main__":
    main()
