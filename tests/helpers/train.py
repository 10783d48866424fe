"""A very small `k3 train` setting: config, corpus, settings, a finished run, and reading a run's losses."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from k3.config import load_config
from k3.data.corpus import load_documents
from k3.train.trainer import Trainer, TrainSettings

REPO = Path(__file__).resolve().parents[2]


def small_config_dir(root: Path) -> str:
    """k3-tiny cut down: 2 layers (KDA + dense FFN, MLA + latent MoE), d=64, 4 experts, AttnRes."""
    cfg = load_config("k3-tiny").replace(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, kda_layers=[], full_attn_layers=[],
        intermediate_size=96, num_experts=4, num_experts_per_token=2, kda_chunk_size=16)
    cfg.save(root / "config")
    return str(root / "config" / "config.json")


def small_corpus(root: Path) -> str:
    text = "".join(d.text for d in load_documents()[:2])[:24_000]
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"doc{i}", "text": text[i * 800:(i + 1) * 800]}) + "\n"
                            for i in range(30)))
    return str(path)


def tiny_settings(root: Path, name: str, **changes) -> TrainSettings:
    base = TrainSettings(config=small_config_dir(root), data=small_corpus(root), out=str(root / name), steps=6,
                         batch_size=4, seq_len=32, lr=3e-3, eval_every=3, eval_windows=2, ckpt_every=2, keep=2,
                         sample_tokens=4, val_fraction=0.1, cache_dir=str(root / "cache"))
    return dataclasses.replace(base, **changes)


def losses(run_dir: str | Path) -> list[float]:
    records = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def quiet(*_a, **_k):
    pass


def trained_tiny_run(root: Path, steps: int = 2) -> Path:
    """A finished `k3 train` run of the small setting (a target for sft / train-draft tests)."""
    trainer = Trainer(tiny_settings(root, "run", steps=steps, ckpt_every=steps), progress=False, log=quiet)
    try:
        trainer.train()
    finally:
        trainer.close()
    return root / "run"
