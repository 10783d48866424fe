"""VisionConfig: MoonViT-V2 and its projector, field names = the official `vision_config` keys.

Read from and written back to the published config.json's `vision_config` losslessly: keys are
written in the order read, keys we do not model (`_attn_implementation`, ...) are kept verbatim,
and an absent key stays absent on write unless its value was changed. Absent keys mean what the
official `VisionTowerConfig` / `ProjectorConfig` (moonshotai/Kimi-K3 `modeling_kimi_k3.py`) make
of them with `getattr(config, key, default)`: no `qkv_hidden_size` = `vt_hidden_size`, no
`norm_type` = LayerNorm, biases on, bilinear interpolation. `VisionConfig()` is K3's tower
(DESIGN §7): 27 layers, width 1024, 12 heads of 128 (`qkv_hidden_size` 1536), MLP 4096, patch 14.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from k3.config import ConfigError

# Keys the official code reads with a getattr default, and that default (what absence means).
_ABSENT_MEANS = {
    "qkv_hidden_size": None, "norm_type": "layernorm", "mlp_type": "mlp2", "attn_bias": True,
    "linear_bias": True, "patch_embed_proj_bias": True, "pos_emb_interpolation_mode": "bilinear",
}
# What each supported string field may be (the official code raises NotImplementedError on others).
_CHOICES = {
    "pos_emb_type": ("divided_fixed",), "merge_type": ("sd2_tpool",), "mlp_type": ("mlp2",),
    "norm_type": ("rmsnorm", "layernorm"), "mm_projector_type": ("patchmergerv2",),
    "pos_emb_interpolation_mode": ("bilinear", "bicubic", "nearest"),
    "activation_func": ("gelu_pytorch_tanh",), "projector_hidden_act": ("gelu",),
}


@dataclass
class VisionConfig:
    # --- tower (MoonViT3dPretrainedModel)
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    patch_embed_proj_bias: bool = False
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int | None = 1536  # None: vt_hidden_size
    vt_intermediate_size: int = 4096
    activation_func: str = "gelu_pytorch_tanh"
    mlp_type: str = "mlp2"
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    # --- projector (PatchMergerMLPV2)
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    # --- verbatim carry-over for lossless writes: keys we do not model, and the keys read, in order
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    _read_keys: tuple[str, ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    # ----------------------------------------------------------------- derived sizes
    @property
    def qkv_size(self) -> int:
        return self.vt_hidden_size if self.qkv_hidden_size is None else self.qkv_hidden_size

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.vt_num_attention_heads

    @property
    def merge_size(self) -> int:
        """Patches per merged token (kh * kw); the projector's input is merge_size * vt_hidden_size."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ConfigError(f"VisionConfig.{name}: {msg}")

        for name in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
                     "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size",
                     "mm_hidden_size", "text_hidden_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, f"must be an integer >= 1, got {v!r}")
        for name, allowed in _CHOICES.items():
            need(getattr(self, name) in allowed, name,
                 f"must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        need(self.qkv_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
             f"{self.qkv_size} must split into {self.vt_num_attention_heads} heads")
        # Rope2DPosEmbRepeated asserts dim % 4 == 0: each head splits into (x, y) rotation pairs.
        need(self.head_dim % 4 == 0, "qkv_hidden_size", f"head dim {self.head_dim} must be a multiple of 4 (2-D RoPE)")
        need(self.vt_hidden_size % 2 == 0, "vt_hidden_size", "must be even (sin/cos temporal table)")
        k = self.merge_kernel_size
        need(isinstance(k, (list, tuple)) and len(k) == 2 and all(isinstance(v, int) and v >= 1 for v in k),
             "merge_kernel_size", f"must be two integers >= 1, got {k!r}")
        # PatchMergerMLPV2 sizes its input from mm_hidden_size; the tower produces vt_hidden_size.
        need(self.mm_hidden_size == self.vt_hidden_size, "mm_hidden_size",
             f"must equal vt_hidden_size ({self.vt_hidden_size}): the projector reads the tower's output, "
             f"got {self.mm_hidden_size}")
        need(self.projector_ln_eps > 0, "projector_ln_eps", f"must be > 0, got {self.projector_ln_eps}")

    # ----------------------------------------------------------------- config.json I/O
    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        """From a published `vision_config` dict; unknown keys are kept for `to_dict`."""
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name != "extra"}
        values = {k: copy.deepcopy(v) for k, v in d.items() if k in names}
        for key, meaning in _ABSENT_MEANS.items():
            values.setdefault(key, meaning)
        missing = sorted(names - set(values))
        if missing:
            raise ConfigError(f"VisionConfig.{missing[0]}: the vision_config has no {missing[0]!r} "
                              f"(the official code reads it without a default)")
        extra = {k: copy.deepcopy(v) for k, v in d.items() if k not in names}
        return cls(**values, extra=extra, _read_keys=tuple(d))

    def to_dict(self) -> dict:
        """The `vision_config` dict: the keys read, in their order, then any key whose value was set."""
        ours = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.name.startswith("_") and f.name != "extra"}
        keys = list(self._read_keys) if self._read_keys is not None else []
        for name, value in ours.items():
            absent_ok = name in _ABSENT_MEANS and value == _ABSENT_MEANS[name]
            if name not in keys and not (self._read_keys is not None and absent_ok):
                keys.append(name)
        keys += [k for k in self.extra if k not in keys]
        return {k: copy.deepcopy(ours[k] if k in ours else self.extra[k]) for k in keys}

    def replace(self, **changes) -> VisionConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
