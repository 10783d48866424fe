"""Speculative decoding: decode throughput with and without the draft, and its mean acceptance
length, at batch 1 and 8 (docs/BENCHMARKS.md "Speculative decoding").

    python -m bench.speculative --run RUN [--draft RUN/draft] [--k 4] [--new-tokens 128]
                                [--device cpu|cuda] [--dtype float32|bfloat16] [--json OUT]

Prompts are windows of the run's held-out text (its run.json's validation split), so neither the
target nor the draft trained on them. Per batch size and mode (greedy, and sampling at
temperature 0.8): the same prompts through an engine without and with speculation (`k`), wall
time of the decode (prefill included, one warm-up batch first; the two engines' runs interleaved
and repeated, the median of each, so a busy machine slows both alike), tokens/s and the speedup; with
speculation the mean acceptance length (tokens emitted per verification, the model's own
included) from the runner's counters. Greedy outputs are also compared token for token.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from k3.checkpoint.draft_folder import load_draft
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.data.corpus import load_documents, split_documents
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.text.tokenizer import load_tokenizer


def held_out_prompts(run: Path, count: int, length: int, seed: int = 0) -> list[list[int]]:
    settings = json.loads((run / "run.json").read_text())
    _, val = split_documents(load_documents(settings.get("data")), settings.get("val_fraction", 0.02))
    tok = load_tokenizer(run)
    ids = np.concatenate([tok.encode(d.text).ids for d in val])
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, count)
    return [ids[s:s + length].tolist() for s in starts]


def timed(engine: LLMEngine, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--draft", help="default RUN/draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each engine, interleaved (median)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-invariant", action="store_true", help="both engines in batch-invariant mode (CPU)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    run = Path(args.run)
    dtype = getattr(torch, args.dtype)
    model = load_pretrained(resolve_checkpoint(run), device=torch.device(args.device), dtype=dtype).eval()
    draft = load_draft(args.draft or run / "draft", model)
    prompts_all = held_out_prompts(run, 8 * 3, args.prompt_len)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode, params in (("greedy", SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)),
                             ("sampling T=0.8", SamplingParams(max_tokens=args.new_tokens, temperature=0.8,
                                                               ignore_eos=True, seed=0))):
            row = {"batch": batch, "mode": mode, "k": args.k}
            engines = {}
            for label, k in (("plain", 0), ("spec", args.k)):
                cfg = EngineConfig(max_num_seqs=max(batch, 8), max_model_len=args.prompt_len + args.new_tokens + 8,
                                   num_speculative_tokens=k, cache_bytes=256 << 20,
                                   batch_invariant=args.batch_invariant)
                engines[label] = LLMEngine(model, cfg, draft=draft if k else None)
                timed(engines[label], prompts_all[:batch], params)  # warm-up
            engines["spec"].runner.spec_counts.clear()
            # interleaved repeats, the median of each: a busy machine slows both alike, not one
            seconds: dict[str, list[float]] = {"plain": [], "spec": []}
            outs = {}
            for _ in range(args.repeats):
                for label, engine in engines.items():
                    t, outs[label] = timed(engine, prompts_all[batch:2 * batch], params)
                    seconds[label].append(t)
            tokens = sum(len(o) for o in outs["plain"])
            for label in engines:
                row[f"{label}_tokens_per_s"] = tokens / float(np.median(seconds[label]))
            c = engines["spec"].runner.spec_counts
            row["mean_acceptance_length"] = 1 + c["accepted"] / max(c["verified"], 1)
            row["drafted"], row["accepted"] = c["drafted"], c["accepted"]
            row["speedup"] = row["spec_tokens_per_s"] / row["plain_tokens_per_s"]
            if mode == "greedy":
                row["greedy_equal"] = outs["plain"] == outs["spec"]
            results.append(row)
            print(f"batch {batch:2d} {mode:15s} plain {row['plain_tokens_per_s']:7.1f} tok/s, spec k={args.k} "
                  f"{row['spec_tokens_per_s']:7.1f} tok/s ({row['speedup']:.2f}x), mean acceptance length "
                  f"{row['mean_acceptance_length']:.2f}" + (f", greedy equal: {row['greedy_equal']}"
                                                            if "greedy_equal" in row else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "results": results},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
