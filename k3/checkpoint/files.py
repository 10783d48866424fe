"""Checkpoint files: an HF-layout folder's JSON and safetensors shards read with errors that name
the file, never a parser traceback. Safetensors only: nothing is ever unpickled. The tensor names
inside are the business of official.py; what a folder holds, of pretrained.py's loader."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, corrupted, not safetensors/JSON); the
    message names the file."""


class CheckpointMismatchError(CheckpointError, KeyError):
    """Tensors missing, unexpected or misnamed for the config. A KeyError (a name lookup failed) and a
    CheckpointError, so verbs report it like any bad checkpoint, without KeyError's quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, the index) as a dict, or CheckpointError naming it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF-layout directory (indexed shards or a single model.safetensors).
    A truncated or corrupted file is a CheckpointError naming it, never a parser traceback."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no weight_map of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no {INDEX_NAME} or model.safetensors in {directory}")
    tensors = {}
    for fname in files:
        path = directory / fname
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {INDEX_NAME} but missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has keys() but is not iterable)
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 (safetensors' SafetensorError derives from Exception only)
            raise CheckpointError(f"{path} is not a readable safetensors file "
                                  f"(truncated or corrupted?): {e}") from None
    return tensors
