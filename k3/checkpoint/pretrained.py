"""The transformers-style face of the checkpoint formats: `K3ForCausalLM.from_pretrained(path)` and
`model.save_pretrained(path)`, exported as `k3.K3ForCausalLM`.

The class is the model of k3/model/transformer.py plus these two methods. They live here, not on
the model, because model code does no file I/O and never imports checkpoint formats
(tests/test_layout.py); both methods are the functions of k3/checkpoint/official.py, so there is
one loader and one writer whichever way they are called.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3.checkpoint.official import DEFAULT_SHARD_BYTES, load_pretrained, save_pretrained
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.model import transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # transformers' spelling of "as stored"
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be a torch.dtype, 'auto' or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


class K3ForCausalLM(transformer.K3ForCausalLM):
    """The K3 text model with transformers' loading and saving methods."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> K3ForCausalLM:
        """The model of an HF-layout folder (or of a `k3 train` run folder: its latest checkpoint),
        in eval mode. Reads every layout `load_pretrained` reads: ours, the official K3 one
        (`language_model.` prefix, sharded with an index, vision tensors skipped), MXFP4-packed
        experts, and Kimi-Linear written by transformers in either config dialect. `dtype`: None or
        "auto" keeps the stored dtype (fp32-by-SPEC tensors stay fp32 whatever it asks)."""
        folder = resolve_checkpoint(path)
        device = None if device is None else torch.device(device)
        return load_pretrained(folder, dtype=_dtype(dtype), device=device, model_class=cls).eval()

    def save_pretrained(self, path: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
        """config.json, safetensors shards and their index, in the official layout and names."""
        return save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
