"""What to serve: a `k3 train` run folder (its latest checkpoint) or any HF-layout checkpoint,
plus its tokenizer.json."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer

from k3.checkpoint.official import load_pretrained
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.text.tokenizer import TOKENIZER_FILE, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_folder(run: str | None, model: str | None) -> Path:
    if (run is None) == (model is None):
        raise ValueError("give exactly one of --run DIR (a `k3 train` run) or --model DIR (an HF-layout checkpoint)")
    if model is not None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not an HF-layout checkpoint folder")
        return path
    return resolve_checkpoint(run)


def load_for_serving(run: str | None = None, model: str | None = None, tokenizer: str | None = None,
                     device: str = "cpu", dtype: str = "float32") -> tuple[torch.nn.Module, Tokenizer, str]:
    """-> (model in eval mode, tokenizer, a served model name)."""
    folder = checkpoint_folder(run, model)
    tok_path = Path(tokenizer) if tokenizer else folder / TOKENIZER_FILE
    if not tok_path.exists():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {folder}; pass --tokenizer PATH")
    tok = load_tokenizer(tok_path)
    net = load_pretrained(folder, device=torch.device(device), dtype=DTYPES[dtype]).eval()
    if tok.get_vocab_size() > net.config.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, the model only {net.config.vocab_size}")
    name = Path(run).name if run else folder.name
    log.info("serving %s (%s) from %s", name, dtype, folder)
    return net, tok, name
