"""`k3 plan --config k3 --gpus 2048 [--gpu h200]`: DP x EP x CP x PP layouts sized on paper.

Prints, best first, the layouts whose memory fits: memory per GPU (weights, gradients, optimizer
state, gathered layers, activations), bytes each GPU sends per step (EP all-to-all, FSDP, CP, PP)
and the step time bound from FLOPs and bandwidth. The model is never built beyond the meta device
(k3/parallel/sizing.py; assumptions in docs/SCALING.md).
"""
from __future__ import annotations

import json

from k3.config import ConfigError, load_config
from k3.parallel.sizing import GPUS, Workload, plan


def add_arguments(p) -> None:
    p.add_argument("--config", default="k3", help="preset name (k3, k3-tiny, k3-1b) or config.json path (default k3)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="device kind (default h200)")
    p.add_argument("--seq-len", type=int, default=Workload.seq_len, help=f"tokens per sequence (default {Workload.seq_len})")
    p.add_argument("--global-tokens", type=int, default=Workload.global_tokens,
                   help=f"tokens per optimizer step (default {Workload.global_tokens:,})")
    p.add_argument("--mfu", type=float, default=Workload.mfu, help=f"achieved share of peak FLOPs (default {Workload.mfu})")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="compute dtype (default bf16 on GPUs, fp32 on cpu)")
    p.add_argument("--ac", choices=("full", "none"), default=None,
                   help="activation checkpointing per layer (default full on GPUs, none on cpu)")
    p.add_argument("--top", type=int, default=12, help="layouts to print (default 12)")
    p.add_argument("--json", action="store_true", help="print every layout as JSON")


def run(args) -> int:
    if args.gpus < 1 or args.seq_len < 1 or args.global_tokens < args.seq_len or not 0 < args.mfu <= 1:
        print("k3 plan: error: need --gpus >= 1, --global-tokens >= --seq-len >= 1 and 0 < --mfu <= 1")
        return 2
    try:
        config = load_config(args.config)
    except (ConfigError, FileNotFoundError) as e:
        print(f"k3 plan: error: {e}")
        return 2
    gpu = GPUS[args.gpu]
    dtype = args.dtype or ("fp32" if args.gpu == "cpu" else "bf16")
    ac = (args.ac or ("none" if args.gpu == "cpu" else "full")) == "full"
    work = Workload(seq_len=args.seq_len, global_tokens=args.global_tokens, mfu=args.mfu, training_dtype=dtype,
                    checkpointing=ac)
    sized = plan(config, args.gpus, gpu, work)
    if args.json:
        print(json.dumps([{"layout": vars(s.layout), "micro_batches": s.micro_batches, "memory_gib": s.memory,
                           "sent_gb": s.comm, "time_s": s.time, "fits": s.fits} for s in sized], indent=1))
        return 0
    fits = [s for s in sized if s.fits]
    print(f"{args.config} on {args.gpus} x {gpu.name} ({gpu.memory_gib:g} GiB): {args.seq_len}-token sequences, "
          f"{args.global_tokens:,} tokens per step, {dtype}, activation checkpointing {'full' if ac else 'none'}, "
          f"MFU {args.mfu:g}; "
          f"{len(fits)} of {len(sized)} layouts fit")
    print("| layout | micro | GiB: weights+grads | optim | gathered | activ | total | "
          "GB sent: EP a2a | FSDP | CP | PP | s: compute | comm | bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shown = (fits or sized)[: args.top]
    for s in shown:
        m, c, t = s.memory, s.comm, s.time
        print(f"| {s.layout} | {s.micro_batches} | {m['weights'] + m['grads']:.1f} | {m['optimizer']:.1f} | "
              f"{m['gathered']:.1f} | {m['activations']:.1f} | {m['total']:.1f}{'' if s.fits else ' (no fit)'} | "
              f"{c['ep_a2a']:.1f} | {c['fsdp']:.1f} | {c['cp']:.2f} | {c['pp']:.2f} | "
              f"{t['compute']:.2f} | {t['comm']:.2f} | {t['bound']:.2f} |")
    if not fits:
        print("no layout fits: more GPUs, shorter sequences or --ac full")
    print("assumptions: docs/SCALING.md (FSDP-sharded fp32 master weights, grads and optimizer state; "
          "activations measured from this model's code; bound = max(compute, communication))")
    return 0
