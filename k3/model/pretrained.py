"""`from_pretrained` / `save_pretrained` on the model classes themselves, transformers-style, so
`k3.K3ForCausalLM` is the one class of that name (and the same for K3ForConditionalGeneration).

Model code does no file I/O and never imports checkpoint formats (tests/test_layout.py), so the
formats come the other way: k3/checkpoint registers each class's reader and writer here when it is
imported, which `from k3 import K3ForCausalLM` (and every loader) does.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

_FORMATS: dict[type, tuple[Callable, Callable]] = {}  # class -> (reader, writer)


def register_format(cls: type, read: Callable, write: Callable) -> None:
    """`read(cls, path, *, dtype, device) -> model` and `write(model, path, **options) -> Path` for `cls`
    and its subclasses."""
    _FORMATS[cls] = (read, write)


def _format(cls: type) -> tuple[Callable, Callable]:
    for c in cls.__mro__:  # FSDP and compile wrap a model in a subclass of its class
        if c in _FORMATS:
            return _FORMATS[c]
    raise RuntimeError(f"no checkpoint format is registered for {cls.__name__}: "
                       f"use `from k3 import {cls.__name__}`, which registers it")


class Pretrained:
    """The loading and saving methods of a model class (the formats: k3/checkpoint)."""

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=None, device=None):
        """The model of a checkpoint folder (or a run folder: its latest checkpoint), in eval mode.
        `dtype`: None or "auto" keeps the stored dtype (fp32-by-design tensors stay fp32)."""
        return _format(cls)[0](cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, **options) -> Path:
        """config.json, safetensors shards and their index, in the official layout and names."""
        return _format(type(self))[1](self, path, **options)
