"""Vision-language configs for joint training from scratch (`k3 train --config k3-tiny-vl`, DESIGN §7).

A VL preset (k3/configs/, the files with a `vision_config`) is a text K3Config plus a VisionConfig
for a tiny MoonViT-V2 tower and its patchmergerv2 projector; the media placeholder id is the last id
of the vocabulary, which the VL trainer's tokenizer reserves for `IMAGE_PLACEHOLDER`
(k3/train/vl_trainer.py). Kept apart from k3/config.py's PRESETS so the text presets (and
everything reading them) stay text. A config.json with a `vision_config` (the published multimodal
layout) also names a VL model. Overrides: K3Config fields by name, VisionConfig fields as
`vision_config.<field>`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from k3 import configs
from k3.config import ConfigError, K3Config
from k3.model.multimodal import K3MultimodalConfig
from k3.model.vision.config import VisionConfig

VISION_PREFIX = "vision_config."


class VLCheckpointConfig(K3MultimodalConfig):
    """A K3MultimodalConfig that the training-state checkpoint code (k3/checkpoint/training_state.py)
    can write: the wrapper's state-dict names (`language_model.*`, `vision_tower.*`, `mm_projector.*`)
    already are the official multimodal names, so no prefix is added (experts are still split per
    expert on save and stacked on load), and the folder is the layout load_pretrained_multimodal reads."""
    checkpoint_prefix = ""

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text_config.tie_word_embeddings


def vl_preset_config(name: str) -> K3MultimodalConfig:
    """VL preset `name` (k3/configs/<name>.json) as a model, not a file: written out whole, as the
    text presets are (k3.config.preset_config)."""
    cfg = K3MultimodalConfig.from_dict(configs.read_preset(name))
    text = dataclasses.replace(cfg.text_config, _text_source=None, _wrapper_source=None)
    vision = dataclasses.replace(cfg.vision_config, _read_keys=None)
    return K3MultimodalConfig(text, vision, cfg.media_placeholder_token_id)


# name -> the preset's K3MultimodalConfig (a fresh one per call)
VL_PRESETS = {name: functools.partial(vl_preset_config, name) for name in configs.preset_names(vision=True)}


def _config_file(name_or_path: str) -> Path | None:
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    return path if path.is_file() else None


def is_vl_config(name_or_path: str | None) -> bool:
    """A VL preset name, or a config.json (or folder holding one) with a `vision_config` object."""
    if name_or_path is None:
        return False
    if str(name_or_path) in VL_PRESETS:
        return True
    path = _config_file(str(name_or_path))
    if path is None:
        return False
    try:
        return isinstance(json.loads(path.read_text()).get("vision_config"), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False  # not ours to judge here: the text loader reports a broken file


def load_vl_config(name_or_path: str, overrides: dict | None = None) -> K3MultimodalConfig:
    """A VL preset or multimodal config.json with overrides applied (ConfigError naming a bad one)."""
    if str(name_or_path) in VL_PRESETS:
        cfg = VL_PRESETS[str(name_or_path)]()
    else:
        path = _config_file(str(name_or_path))
        if path is None:
            raise ConfigError(f"unknown VL preset or missing config path {str(name_or_path)!r}; "
                              f"VL presets: {', '.join(VL_PRESETS)}")
        cfg = K3MultimodalConfig.from_dict(json.loads(path.read_text()))
    text_changes, vision_changes = {}, {}
    for key, value in (overrides or {}).items():
        if key.startswith(VISION_PREFIX):
            vision_changes[key[len(VISION_PREFIX):]] = value
        else:
            text_changes[key] = value
    text_fields = {f.name for f in dataclasses.fields(K3Config)}
    vision_fields = {f.name for f in dataclasses.fields(VisionConfig) if not f.name.startswith("_")} - {"extra"}
    unknown = sorted(set(text_changes) - text_fields) + sorted(VISION_PREFIX + k for k in set(vision_changes) - vision_fields)
    if unknown:
        raise ConfigError(f"unknown config fields in overrides: {unknown} (vision fields as {VISION_PREFIX}<field>)")
    text = cfg.text_config
    if text_changes:
        if "num_hidden_layers" in text_changes:  # re-derive K3's layer schedule for the new depth
            text_changes.setdefault("kda_layers", [])
            text_changes.setdefault("full_attn_layers", [])
        text = text.replace(**text_changes)
    vision = cfg.vision_config
    if "hidden_size" in text_changes and "text_hidden_size" not in vision_changes:
        vision_changes["text_hidden_size"] = text.hidden_size  # the projector follows the LM width
    if "vt_hidden_size" in vision_changes and "mm_hidden_size" not in vision_changes:
        vision_changes["mm_hidden_size"] = vision_changes["vt_hidden_size"]
    if vision_changes:
        vision = vision.replace(**vision_changes)
    placeholder = cfg.media_placeholder_token_id
    if str(name_or_path) in VL_PRESETS and "vocab_size" in text_changes:
        placeholder = text.vocab_size - 1
    return K3MultimodalConfig(text, vision, media_placeholder_token_id=placeholder)
