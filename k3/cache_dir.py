"""Where k3 caches what it can rebuild (trained tokenizers, tokenized corpora, converted tiktoken
folders): the folder given, else $K3_CACHE_DIR, else ~/.cache/k3."""
from __future__ import annotations

import os
from pathlib import Path


def resolve_cache_dir(given: str | Path | None = None) -> Path:
    return Path(given or os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3")
