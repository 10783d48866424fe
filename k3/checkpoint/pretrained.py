"""The transformers-style face of the checkpoint formats: `K3ForCausalLM.from_pretrained(path)` and
`model.save_pretrained(path)` on the model's own class (k3/model/pretrained.py), exported as
`k3.K3ForCausalLM`.

Model code does no file I/O and never imports checkpoint formats (tests/test_layout.py), so this
module registers its reader and official.py's writer with the model class when imported. It is
also the loader every verb uses (`load_pretrained`: which layout a folder holds, and the model
filled from it), so there is one loader and one writer whichever way they are called.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3.checkpoint.files import (
    CheckpointError,
    CheckpointMismatchError,
    read_json,
    read_safetensors,
)
from k3.checkpoint.official import official_to_state_dict, save_pretrained
from k3.checkpoint.packed import is_packed_checkpoint, read_packed
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.config import ConfigError, K3Config
from k3.model.precision import fp32_tensor_names
from k3.model.pretrained import register_format
from k3.model.transformer import K3ForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # transformers' spelling of "as stored"
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be a torch.dtype, 'auto' or one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None):
    """`cls.from_pretrained`: the model of an HF-layout folder (or of a `k3 train` run folder: its
    latest checkpoint), in eval mode. Reads every layout `load_pretrained` reads: ours, the official
    K3 one (`language_model.` prefix, sharded with an index, vision tensors skipped), MXFP4-packed
    experts, and Kimi-Linear written by transformers in either config dialect. `dtype`: None or
    "auto" keeps the stored dtype (fp32-by-design tensors stay fp32 whatever it asks)."""
    folder = resolve_checkpoint(path)
    device = None if device is None else torch.device(device)
    return load_pretrained(folder, dtype=as_dtype(dtype), device=device, model_class=cls).eval()


def load_pretrained(directory: str | Path, *, device=None, dtype: torch.dtype | None = None,
                    config: K3Config | None = None, model_class=None):
    """Build a K3ForCausalLM from an HF-layout directory: ours, the official layout (incl. the
    MXFP4 `mxfp4-pack-quantized` routed experts, dequantized at load by k3/quant), or one written by
    transformers' KimiLinearForCausalLM. Every parameter must be present: missing or unexpected
    tensors are an error naming them. fp32-by-design tensors stay fp32 whatever `dtype` asks.
    `model_class` (default `k3.K3ForCausalLM`) is the class built; `K3ForCausalLM.from_pretrained`
    is this function."""
    model_class = model_class or K3ForCausalLM
    config, tensors = read_checkpoint(directory, dtype=dtype, config=config)
    tensors = official_to_state_dict(config, tensors)
    with torch.device("meta"):
        model = model_class(config)
    assign_checkpoint(model, tensors, directory, device=device, dtype=dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def read_checkpoint(directory: str | Path, *, dtype: torch.dtype | None = None,
                    config: K3Config | None = None) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """The text config (`config` if given, else config.json's) and every tensor of an HF-layout
    directory under its file name, MXFP4-packed experts dequantized (to `dtype` if given)."""

    directory = Path(directory)
    try:
        if is_packed_checkpoint(directory):
            packed_config, tensors = read_packed(directory, dtype=dtype)
            return config or packed_config, tensors
        if config is None:
            if not (directory / "config.json").is_file():
                raise FileNotFoundError(f"no config.json in {directory}")
            try:
                config = K3Config.from_dict(read_json(directory / "config.json"))
            except (KeyError, TypeError) as e:
                raise CheckpointError(f"{directory / 'config.json'} is not a model config ({e})") from None
        return config, read_safetensors(directory)
    except ConfigError as e:  # malformed or self-contradicting fields: the message names them
        raise ConfigError(f"{directory / 'config.json'}: {e}") from None


def assign_checkpoint(model, tensors: dict[str, torch.Tensor], directory: str | Path, *, device=None,
                      dtype: torch.dtype | None = None) -> None:
    """Fill a meta-built `model` with `tensors` (its own state-dict names): every name present and
    no other, shapes equal; fp32-by-design tensors stay fp32 whatever `dtype` asks."""
    expected = set(model.state_dict().keys())
    fp32 = fp32_tensor_names(model)
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    if missing or unexpected:
        raise CheckpointMismatchError(f"checkpoint {directory} does not match the config: missing {sorted(missing)[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}, unexpected {sorted(unexpected)[:8]}"
                       f"{' ...' if len(unexpected) > 8 else ''}")
    state = {}
    for name, ref in model.state_dict().items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(ref.shape)}")
        target = torch.float32 if name in fp32 else (t.dtype if dtype is None else dtype)
        state[name] = t.to(device=device, dtype=target)
    model.load_state_dict(state, assign=True, strict=True)


register_format(K3ForCausalLM, from_pretrained, save_pretrained)
