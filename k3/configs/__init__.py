"""The model presets: one config.json per preset in this folder, in the published layout (`kimi_k3`
with a `text_config`, plus a `vision_config` for a vision-language preset), named by its file:
`--config k3-tiny` reads k3-tiny.json. A file added here is a preset. k3.config.load_config reads
the text presets, k3.train.vl_config.load_vl_config the VL ones; both give a preset as a model
(written out whole), not as a file to echo back.

  k3          the official Kimi K3 text model (DESIGN §1); equal to the published config's fields
  k3-tiny     a few million parameters; trains on a 2-core CPU in minutes. Keeps K3's structure:
              3:1 KDA:MLA with a final MLA, dense layer 0, AttnRes blocks, latent MoE at d/2, SiTU
  k3-1b       ~1.4B total / ~0.3B active, for one GPU: K3's ratios at d=1024 (top-k/E = 2/128 ~ K3's 16/896)
  k3-slice    K3's widths on one GPU (the GPU benchmarks' shape): every per-layer shape of the official
              config (hidden 7168, 96 KDA and MLA heads, q/kv LoRA, latent MoE 3584 -> 3072, SiTU, 2
              shared experts, dense layer 0) with 4 layers (3 KDA, then the final MLA, in two AttnRes
              blocks of 2), 16 routed experts, top-8, and a 32K vocabulary. Per token, a KDA, MLA or
              dense layer costs what K3's does; a MoE layer half (8 routed experts of K3's 16)
  k3-tiny-vl  k3-tiny plus MoonViT-V2 at CPU scale: 4 blocks of width 128 (4 heads of 32), MLP 256,
              patch 14, 2 x 2 merge, a 6 x 6 position table (the default 84-px scenes' own grid, so no
              resize) and a patchmergerv2 projector to the LM width. The media placeholder is the
              vocabulary's last id; KDA works in 32-token chunks: VL documents are short (a scene and a
              few questions), and a 64-token chunk would mostly be padding there (a runtime choice,
              not a model change: k3/model/kda.py)

Nothing here imports k3: the config classes import this folder's names.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def preset_file(name: str) -> Path | None:
    """The file of preset `name`, or None when there is no such preset."""
    path = FOLDER / f"{name}.json"
    return path if name and "/" not in name and "\\" not in name and path.is_file() else None


@cache
def preset_names(vision: bool = False) -> tuple[str, ...]:
    """The text presets (or, with `vision`, the vision-language ones), sorted."""
    return tuple(sorted(p.stem for p in FOLDER.glob("*.json")
                        if ("vision_config" in json.loads(p.read_text(encoding="utf-8"))) == vision))


def read_preset(name: str) -> dict:
    """Preset `name`'s config.json dict (KeyError naming the presets when there is none)."""
    path = preset_file(name)
    if path is None:
        raise KeyError(f"no preset {name!r}; presets: {', '.join(preset_names() + preset_names(vision=True))}")
    return json.loads(path.read_text(encoding="utf-8"))
