"""The draft's training data: the target's own outputs (DESIGN §12.5; EAGLE trains on what the
target generates, not on the corpus, since at serving time the draft must predict the target).

Prompts are short windows of the run's training text; the target continues each, greedily for
some (what greedy serving verifies against) and at temperature 1 for the rest (what sampling
sees, and more varied text).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from k3.data.corpus import load_documents, split_documents
from k3.generation.generate import generate
from k3.train.packing import cached_token_stream


def corpus_prompts(run_dir: Path, tokenizer, config, count: int, length: int, seed: int,
                   cache_dir: Path) -> list[list[int]]:
    """`count` windows of `length` tokens from the run's training split (its run.json's data)."""
    run = json.loads((run_dir / "run.json").read_text())
    train_docs, _ = split_documents(load_documents(run.get("data")), run.get("val_fraction", 0.02))
    stream = cached_token_stream(cache_dir / "tokens", tokenizer, [d.text for d in train_docs],
                                 config.bos_token_id, config.eos_token_id)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream.tokens) - length, count)
    return [stream.tokens[s:s + length].tolist() for s in starts]


@torch.no_grad()
def target_outputs(model, prompts: list[list[int]], new_tokens: int, *, sampled_fraction: float, seed: int,
                   batch: int = 64, on_batch=None) -> torch.Tensor:
    """[len(prompts), prompt + new_tokens]: each prompt and the target's continuation; the first
    (1 - sampled_fraction) of the prompts greedy, the rest sampled at temperature 1."""
    greedy_until = round(len(prompts) * (1 - sampled_fraction))
    rows = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        kinds = [i + start < greedy_until for i in range(len(chunk))]
        out = [None] * len(chunk)
        for greedy in (True, False):
            idx = [i for i, g in enumerate(kinds) if g == greedy]
            if idx:
                new = generate(model, [chunk[i] for i in idx], new_tokens, temperature=0.0 if greedy else 1.0,
                               seed=seed + start)
                for i, n in zip(idx, new):
                    out[i] = chunk[i] + n
        rows += out
        if on_batch is not None:
            on_batch(min(start + batch, len(prompts)), len(prompts))
    return torch.tensor(rows, dtype=torch.long)
