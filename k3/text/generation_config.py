"""A checkpoint folder's generation_config.json (transformers' file): the sampling values a request
that names none gets, and the extra ids that end a reply (`eos_token_id`, an id or a list)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from k3.sampling import check_sampling

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None  # None: the caller's own default
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()


def _number(config: dict, key: str, kind, path: Path):
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{path}: {key} must be a {'number' if kind is not int else 'whole number'}, got {value!r}")  # noqa: TRY004 (a bad file, not a bad argument)
    return value


def read_json_object(path: Path) -> dict:
    """A release's JSON file as a dict; ValueError in one line naming the file if it is not one."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not an object")  # noqa: TRY004 (a bad file, not a bad argument)
    return config


def read_generation_config(folder: str | Path) -> GenerationDefaults:
    """The folder's defaults (all None without the file); ValueError in one line naming a bad field.
    `do_sample: false` means greedy (temperature 0), as in transformers."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults()
    config = read_json_object(path)
    temperature = _number(config, "temperature", (int, float), path)
    top_p = _number(config, "top_p", (int, float), path)
    top_k = _number(config, "top_k", int, path)
    if config.get("do_sample") is False:
        temperature = 0.0
    try:
        check_sampling(0.0 if temperature is None else float(temperature), 1.0 if top_p is None else float(top_p),
                       top_k or 0)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    max_new = _number(config, "max_new_tokens", int, path)
    eos = config.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
        raise ValueError(f"{path}: eos_token_id must be an id or a list of ids, got {config.get('eos_token_id')!r}")
    return GenerationDefaults(None if temperature is None else float(temperature),
                              None if top_p is None else float(top_p), top_k,
                              max_new if max_new is None or max_new > 0 else None, tuple(eos))
