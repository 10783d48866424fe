"""`k3 train-draft --run DIR`: train the speculative draft for a `k3 train` (or `k3 sft`) run on
the target's own outputs and save it as DIR/draft (safetensors + draft.json); serve with
`k3 serve --run DIR --draft DIR/draft --num-speculative-tokens 4`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from k3.cache_dir import resolve_cache_dir
from k3.draft.trainer import DraftSettings

FIELDS = ("steps", "batch_size", "seq_len", "prompt_len", "num_sequences", "sampled_fraction", "unroll",
          "anchor_every", "lr", "seed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DraftSettings()
    p.add_argument("--run", required=True, help="the run folder (its latest checkpoint is the target)")
    p.add_argument("--out", help="where to write the draft (default RUN/draft)")
    for name in FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(d, name)), help=f"(default {getattr(d, name)})")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--cache-dir", help="token cache (default $K3_CACHE_DIR or ~/.cache/k3)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(message: str) -> int:
    print(f"k3 train-draft: error: {message}", file=sys.stderr)
    return 2


def expected_acceptance_length(accept: list[float], k: int) -> float:
    """Tokens per verification at k drafts when draft step i is accepted with probability
    accept[i] (independently): 1 + sum_i prod_{j<=i} accept[j]."""
    total, prod = 1.0, 1.0
    for a in accept[:k]:
        prod *= a
        total += prod
    return total


def run(args) -> int:
    import torch

    from k3.atomic import write_text_atomic
    from k3.checkpoint.draft_folder import save_draft
    from k3.checkpoint.pretrained import load_pretrained
    from k3.checkpoint.run_folder import resolve_checkpoint
    from k3.draft.data import corpus_prompts, target_outputs
    from k3.draft.trainer import DraftTrainer
    from k3.model.draft import EagleDraft
    from k3.text.tokenizer import load_tokenizer
    from k3.train.progress import Progress

    settings = dataclasses.replace(DraftSettings(), **{f: getattr(args, f) for f in FIELDS
                                                        if getattr(args, f) is not None})
    run_dir = Path(args.run)
    if settings.prompt_len >= settings.seq_len or settings.prompt_len < 1:
        return _error(f"--prompt-len must be in [1, --seq-len), got {settings.prompt_len}")
    if settings.unroll < 1 or settings.anchor_every < 1 or settings.steps < 1 or settings.batch_size < 1:
        return _error("--unroll, --anchor-every, --steps and --batch-size must be >= 1")
    try:
        folder = resolve_checkpoint(run_dir)
        if not (run_dir / "run.json").is_file():
            raise ValueError(f"{run_dir} has no run.json: give a `k3 train` or `k3 sft` run folder")
        tokenizer = load_tokenizer(run_dir)
        target = load_pretrained(folder, device=torch.device(args.device)).eval()
    except (ValueError, OSError) as e:
        return _error(str(e))
    out = Path(args.out) if args.out else run_dir / "draft"
    cache = resolve_cache_dir(args.cache_dir)
    torch.manual_seed(settings.seed)
    print(f"target: {folder}; draft -> {out}", flush=True)
    prompts = corpus_prompts(run_dir, tokenizer, target.config, settings.num_sequences, settings.prompt_len,
                             settings.seed, cache)
    data = target_outputs(target, prompts, settings.seq_len - settings.prompt_len,
                          sampled_fraction=settings.sampled_fraction, seed=settings.seed,
                          on_batch=lambda done, total: print(f"target outputs: {done}/{total}", flush=True))
    # short KDA chunks: a 64-token chunk would pad each training segment (anchor_every pairs) to 64
    draft = EagleDraft(target.config.replace(kda_chunk_size=16)).to(args.device)
    progress = None if args.no_progress else Progress(settings.steps, 0)
    records = DraftTrainer(target, draft, settings).train(data, progress)
    if progress is not None:
        progress.close()
    # acceptance per unrolled step, from the last 10% of steps: P(accept) = sum_v min(p, q) = exp(-LK)
    tail = records[-max(1, len(records) // 10):]
    accept = [sum(math.exp(-r["per_step"][i]) for r in tail) / len(tail) for i in range(len(tail[0]["per_step"]))]
    summary = {"settings": dataclasses.asdict(settings), "checkpoint": str(folder),
               "final_loss": tail[-1]["loss"], "acceptance_per_step": accept,
               "expected_acceptance_length_k4": expected_acceptance_length(accept, 4)}
    save_draft(draft, target, out, extra={"training": summary})
    write_text_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    print(f"draft saved to {out}: LK loss {summary['final_loss']:.3f}; sampling acceptance per step "
          f"{', '.join(f'{a:.2f}' for a in accept)}; expected tokens per verification at k=4 "
          f"{summary['expected_acceptance_length_k4']:.2f} (measure it: bench/speculative.py)")
    return 0
