"""Where a served model's files are: the checkpoint folder of `--run`/`--model` and its tokenizer.
Torch-free, so that `k3 route` finds the replicas' tokenizer without loading torch."""
from __future__ import annotations

from pathlib import Path

from k3.checkpoint.run_folder import resolve_checkpoint
from k3.text.tiktoken_folder import TIKTOKEN_FILE
from k3.text.tokenizer import TOKENIZER_FILE


def checkpoint_folder(run: str | None, model: str | None) -> Path:
    if (run is None) == (model is None):
        raise ValueError("give exactly one of --run DIR (a `k3 train` run) or --model DIR (an HF-layout checkpoint)")
    return resolve_checkpoint(run if model is None else model)  # either takes a checkpoint or a run folder


def tokenizer_path(folder: Path, tokenizer: str | None) -> Path:
    """The tokenizer's source: --tokenizer (a file or a folder), else the checkpoint folder, which
    holds a tokenizer.json or a release's tiktoken.model."""
    path = Path(tokenizer) if tokenizer else folder
    if not path.exists() or path.is_dir() and not ((path / TOKENIZER_FILE).is_file() or (path / TIKTOKEN_FILE).is_file()):
        raise FileNotFoundError(f"no {TOKENIZER_FILE} or {TIKTOKEN_FILE} in {path}; pass --tokenizer PATH")
    return path / TOKENIZER_FILE if path.is_dir() and (path / TOKENIZER_FILE).is_file() else path
