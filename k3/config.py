"""K3Config: the text model's configuration, field names = the official `text_config` keys.

Reads and writes the published config.json of `moonshotai/Kimi-K3` (top level `kimi_k3` with a
`text_config`) and of `moonshotai/Kimi-Linear-48B-A3B` (flat `kimi_linear`). Writing back is
lossless: keys we do not model are kept verbatim, keys that were absent stay absent (absence has
meaning: no `gate_lower_bound` = softplus gate, no `attn_res_block_size` = plain residual;
DESIGN §1). Layer lists in `linear_attn_config` are 1-INDEXED, as published.

Kimi-Linear configs come in two dialects: the official one (`linear_attn_config`, as published)
and transformers' native one (what `KimiLinearConfig(layer_types=...)` writes: per-layer
`layer_types` / `mlp_layer_types` lists and flat `linear_*` sizes, `model_max_length`, ...).
Both are read, with transformers' precedence where both are present (see `_read_native`); fields
that contradict each other are a ConfigError naming them, never a silently different model.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3 import configs
from k3.atomic import write_text_atomic

# Keys of `linear_attn_config` we model, mapped to our flat field names.
_LINEAR_ATTN_KEYS = {
    "kda_layers": "kda_layers",
    "full_attn_layers": "full_attn_layers",
    "head_dim": "kda_head_dim",
    "num_heads": "kda_num_heads",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}
# Fields whose "absent" value changes the architecture; never written when absent and unset.
_ABSENT_MEANS_DEFAULT = {
    "gate_lower_bound": None, "use_full_rank_gate": False, "attn_res_block_size": None,
    "routed_expert_hidden_size": None, "latent_moe_use_norm": False, "mla_use_output_gate": False,
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "q_lora_rank": None,
}
# transformers' native Kimi-Linear keys (configuration_kimi_linear.py): flat KDA sizes, each
# mirroring a `linear_attn_config` key, and its attribute_map's other names for our fields.
_NATIVE_LINEAR_KEYS = {"linear_head_dim": "head_dim", "linear_num_heads": "num_heads",
                       "linear_conv_kernel_dim": "short_conv_kernel_size"}
_NATIVE_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
                   "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
                   "n_group": "num_expert_group", "model_max_length": "max_position_embeddings"}
LAYER_TYPES = ("linear_attention", "full_attention")  # `layer_types` entries: KDA, MLA
MLP_LAYER_TYPES = ("dense", "sparse")  # `mlp_layer_types` entries: dense FFN, MoE
# Our own runtime choices (not in the official schema); written under these names only.
_K3_RUNTIME_KEYS = ("mla_impl", "kda_impl", "kda_chunk_size")
MLA_IMPLS = ("auto", "naive", "absorb")


_TYPE_NAMES = {"int": "an integer", "int | None": "an integer or null", "float": "a number",
               "float | None": "a number or null", "bool": "true or false", "str": "a string",
               "str | None": "a string or null", "list[int]": "a list of integers", "dict | None": "an object or null"}


def _has_type(value, annotation: str) -> bool:
    """`value` fits a K3Config field's annotation (as JSON has it: a bool is no number)."""
    if annotation.endswith(" | None"):
        return value is None or _has_type(value, annotation[:-len(" | None")])
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if annotation == "list[int]":
        return isinstance(value, (list, tuple)) and all(_has_type(v, "int") for v in value)
    return isinstance(value, {"bool": bool, "str": str, "dict": dict}.get(annotation, object))


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the constraint."""


@dataclass
class K3Config:
    # --- sizes
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    hidden_act: str = "situ"  # "situ" (SiTU-GLU) or "silu" (SwiGLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int | None = 12  # None: plain pre-norm residual
    # --- KDA (linear_attn_config)
    kda_layers: list[int] = field(default_factory=list)  # 1-indexed
    full_attn_layers: list[int] = field(default_factory=list)  # 1-indexed
    kda_head_dim: int = 128
    kda_num_heads: int = 96
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: Kimi-Linear softplus gate
    use_full_rank_gate: bool = True  # output gate g_proj (K3) vs low-rank g_a/g_b (Kimi Linear)
    # --- MLA
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True  # False: decoupled RoPE on the pe slot (an ablation; k3/model/mla.py)
    rope_theta: float = 10000.0  # read only when mla_use_nope is False
    mla_use_output_gate: bool = True
    # --- MoE
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # None: classic (full-width) MoE
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0
    # --- special tokens
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    # --- our runtime choices (modes as config fields, not magic switches)
    # "naive" | "absorb" (absorbed attention over the latent cache) | "auto": absorbed for one-token
    # queries (decode), naive otherwise (k3/model/mla.py)
    mla_impl: str = "auto"
    kda_impl: str = "auto"  # "auto" | "chunk" | "recurrent" | "fla"
    kda_chunk_size: int = 64
    # --- verbatim carry-over for lossless writes
    _text_source: dict | None = field(default=None, repr=False, compare=False)
    _wrapper_source: dict | None = field(default=None, repr=False, compare=False)
    wrapper_model_type: str | None = "kimi_k3"  # "kimi_k3": multimodal wrapper; None: flat kimi_linear

    def __post_init__(self):
        if not self.kda_layers and not self.full_attn_layers:
            self.full_attn_layers = default_full_attn_layers(self.num_hidden_layers)
            self.kda_layers = [i for i in range(1, self.num_hidden_layers + 1) if i not in self.full_attn_layers]
        self.validate()

    # ----------------------------------------------------------------- derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_mla_layer(self, idx: int) -> bool:
        """idx is 0-based; the published lists are 1-based (DESIGN §2)."""
        return (idx + 1) in self.full_attn_layers

    def is_moe_layer(self, idx: int) -> bool:
        return self.num_experts > 0 and idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0

    @property
    def mla_cache_width(self) -> int:
        """What an MLA layer caches per token: the compressed latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.full_attn_layers)

    @property
    def moe_hidden_size(self) -> int:
        """Width the routed experts see: the latent size for Stable LatentMoE, else hidden."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def checkpoint_prefix(self) -> str:
        """Official tensor-name prefix of the text model (DESIGN §1, §10)."""
        return "language_model." if self.wrapper_model_type == "kimi_k3" else ""

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, fieldname: str, msg: str):
            if not cond:
                raise ConfigError(f"K3Config.{fieldname}: {msg}")

        for f in dataclasses.fields(self):  # JSON types first: `true` is no layer count, "128" no width
            value = getattr(self, f.name)
            need(_has_type(value, f.type), f.name, f"must be {_TYPE_NAMES.get(f.type, f.type)}, got {value!r}")

        n = self.num_hidden_layers
        need(n >= 1, "num_hidden_layers", f"must be >= 1, got {n}")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "kda_head_dim", "kda_num_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
            need(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             f"MLA has as many kv heads as query heads ({self.num_attention_heads}), got {self.num_key_value_heads}")
        both = set(self.kda_layers) & set(self.full_attn_layers)
        need(not both, "linear_attn_config", f"layers {sorted(both)} are in both kda_layers and full_attn_layers")
        covered = sorted(set(self.kda_layers) | set(self.full_attn_layers))
        need(covered == list(range(1, n + 1)), "linear_attn_config",
             f"kda_layers + full_attn_layers (1-indexed) must cover 1..{n} exactly once; "
             f"missing {sorted(set(range(1, n + 1)) - set(covered))}, out of range {sorted(set(covered) - set(range(1, n + 1)))}")
        need(len(self.kda_layers) + len(self.full_attn_layers) == n, "linear_attn_config", "duplicate layer indices")
        if self.gate_lower_bound is not None:
            need(-5.0 <= self.gate_lower_bound < 0.0, "gate_lower_bound",
                 f"must lie in [-5, 0) (the chunked kernels' tile-range bound, DESIGN §3), got {self.gate_lower_bound}")
        need(self.short_conv_kernel_size >= 1, "short_conv_kernel_size", "must be >= 1")
        need(self.hidden_act in ("situ", "silu"), "hidden_act", f"must be 'situ' or 'silu', got {self.hidden_act!r}")
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size >= 1, "attn_res_block_size", "must be >= 1 or absent")
        if self.num_experts > 0:
            need(1 <= self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_token}")
            need(self.moe_router_activation_func == "sigmoid", "moe_router_activation_func", "only 'sigmoid' is supported")
            need(self.topk_method == "noaux_tc", "topk_method", "only 'noaux_tc' is supported")
            need(self.num_expert_group == 1 and self.topk_group == 1, "num_expert_group",
                 "grouped top-k with more than one group is not supported (K3 uses 1/1, a no-op)")
            need(self.moe_intermediate_size >= 1, "moe_intermediate_size", "must be >= 1")
            if self.routed_expert_hidden_size is not None:
                need(1 <= self.routed_expert_hidden_size, "routed_expert_hidden_size", "must be >= 1")
        need(self.first_k_dense_replace >= 0, "first_k_dense_replace", "must be >= 0")
        need(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
        need(self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank", "must be >= 1 or null")
        need(self.mla_impl in MLA_IMPLS, "mla_impl", f"must be one of {MLA_IMPLS}, got {self.mla_impl!r}")
        need(self.kda_impl in ("auto", "chunk", "recurrent", "fla"), "kda_impl",
             f"must be one of auto/chunk/recurrent/fla, got {self.kda_impl!r}")
        need(self.kda_chunk_size in (16, 32, 64), "kda_chunk_size", f"must be 16, 32 or 64, got {self.kda_chunk_size}")

    # ----------------------------------------------------------------- JSON I/O
    @classmethod
    def from_dict(cls, d: dict) -> K3Config:
        d = copy.deepcopy(d)
        wrapper = None
        if "text_config" in d:  # kimi_k3: multimodal wrapper around a kimi_linear text config
            # text_config kept as a marker of its place: to_dict writes the published key order back
            wrapper = {k: (None if k == "text_config" else v) for k, v in d.items()}
            text = d["text_config"]
        else:
            text = d
        if not isinstance(text, dict) or not isinstance(text.get("linear_attn_config", {}), dict):
            raise ConfigError("K3Config.linear_attn_config: text_config and linear_attn_config must be JSON objects")
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        kwargs: dict[str, Any] = {}
        for key, value in text.items():
            if key == "linear_attn_config":
                for lk, fname in _LINEAR_ATTN_KEYS.items():
                    if lk in value:
                        kwargs[fname] = value[lk]
            elif key in known and key not in _LINEAR_ATTN_KEYS.values():
                kwargs[key] = value
        kwargs.update(_read_native(text))
        # Absence has meaning for these (DESIGN §1 table: "absent" column).
        for key, absent_value in _ABSENT_MEANS_DEFAULT.items():
            la = text.get("linear_attn_config", {})
            present = key in text or key in la
            if not present:
                kwargs[key] = absent_value
        kwargs["wrapper_model_type"] = wrapper.get("model_type") if wrapper else None
        cfg = cls(**kwargs, _text_source=text, _wrapper_source=wrapper)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> K3Config:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path} is not a JSON file: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds {type(data).__name__}, not a config object")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """The config.json dict; lossless for a config that came from a file."""
        text = copy.deepcopy(self._text_source) if self._text_source is not None else {
            "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        la = text.setdefault("linear_attn_config", {})
        defaults = {f.name: f.default for f in dataclasses.fields(self)}

        def keep_absent(name: str, value) -> bool:
            # A key missing from the source file stays missing while it holds its "absent" value;
            # our runtime keys are written only when changed.
            absent = _ABSENT_MEANS_DEFAULT.get(name, defaults[name])
            return value == absent and (self._text_source is not None or name in _K3_RUNTIME_KEYS)

        for lk, fname in _LINEAR_ATTN_KEYS.items():
            if lk not in la and not keep_absent(fname, getattr(self, fname)) or lk in la:
                la[lk] = getattr(self, fname)
        _write_native(self, text)  # a source in transformers' dialect keeps it, in step with our fields
        aliased = {_NATIVE_ALIASES[k] for k in text if k in _NATIVE_ALIASES}
        for name in defaults:
            if name.startswith("_") or name == "wrapper_model_type" or name in _LINEAR_ATTN_KEYS.values():
                continue
            value = getattr(self, name)
            if name in text or name not in aliased and not keep_absent(name, value):
                text[name] = value
        if self.wrapper_model_type is None:
            return text
        wrapper = copy.deepcopy(self._wrapper_source) if self._wrapper_source is not None else {
            "architectures": ["KimiK3ForConditionalGeneration"], "model_type": self.wrapper_model_type,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "tie_word_embeddings": self.tie_word_embeddings}
        out = {}
        # keep the published key order: text_config sits where it was
        keys = list(wrapper.keys())
        if "text_config" not in keys:
            keys.append("text_config")
        for k in keys:
            out[k] = text if k == "text_config" else wrapper[k]
        return out

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(directory / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes) -> K3Config:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------- transformers' dialect
def _type_list(text: dict, key: str, allowed: tuple[str, ...], n: int) -> list[str]:
    value = text[key]
    if not isinstance(value, list) or any(v not in allowed for v in value):
        shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:117] + "..."
        raise ConfigError(f"K3Config.{key}: must be a list of {' / '.join(map(repr, allowed))}, got {shown}")
    if len(value) != n:
        raise ConfigError(f"K3Config.{key}: has {len(value)} entries, num_hidden_layers is {n}")
    return value


def _moe_pattern(first_k_dense_replace: int, moe_layer_freq: int, n: int) -> list[str]:
    """mlp_layer_types as K3Config.is_moe_layer draws them (for a model with experts)."""
    return ["sparse" if i >= first_k_dense_replace and i % moe_layer_freq == 0 else "dense" for i in range(n)]


def _read_native(text: dict) -> dict[str, Any]:
    """Our fields from transformers' native Kimi-Linear keys. Where both dialects give a value they
    must agree; transformers' precedence (KimiLinearConfig.__post_init__) says which one is the
    source: `linear_attn_config` over the flat `linear_*` sizes, `layer_types` over the layer lists
    of `linear_attn_config`, `mlp_layer_types` over `first_k_dense_replace`, and an attribute_map
    name (`num_local_experts`, ...) is the field it maps to."""
    la = text.get("linear_attn_config", {})
    n = text.get("num_hidden_layers", K3Config.num_hidden_layers)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ConfigError(f"K3Config.num_hidden_layers: must be an integer, got {n!r}")
    out: dict[str, Any] = {}
    for alias, name in _NATIVE_ALIASES.items():
        if alias in text:
            if name in text and text[name] != text[alias]:
                raise ConfigError(f"K3Config.{name}: {name} {text[name]!r} and {alias} {text[alias]!r} disagree")
            out[name] = text[alias]
    for key, lk in _NATIVE_LINEAR_KEYS.items():
        if key in text:
            if lk in la and la[lk] != text[key]:
                raise ConfigError(f"K3Config.{key}: {key} {text[key]!r} and linear_attn_config.{lk} {la[lk]!r} "
                                  f"disagree")
            out[_LINEAR_ATTN_KEYS[lk]] = la.get(lk, text[key])
    if "layer_types" in text:
        types = _type_list(text, "layer_types", LAYER_TYPES, n)
        layers = {"kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
                  "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"]}
        for lk, ours in layers.items():
            theirs = la.get(lk, ours)
            if not isinstance(theirs, list) or len(theirs) != len(set(theirs)):
                raise ConfigError(f"K3Config.linear_attn_config: {lk} must be a list of distinct layers, "
                                  f"got {theirs!r}")
            odd = sorted(set(ours) ^ set(theirs), key=lambda v: (not isinstance(v, int), str(v).zfill(12)))
            if odd:
                i = odd[0]
                said = (f"layer_types[{i - 1}] is {types[i - 1]!r}" if i in range(1, n + 1)
                        else "layer_types has no such layer")
                raise ConfigError(f"K3Config.layer_types: contradicts linear_attn_config.{lk}, which "
                                  f"{'lists' if i in theirs else 'omits'} layer {i!r} (1-indexed): {said}")
        out.update(layers)
    if "mlp_layer_types" in text:
        types = _type_list(text, "mlp_layer_types", MLP_LAYER_TYPES, n)
        sparse = [i for i, t in enumerate(types) if t == "sparse"]
        if not out.get("num_experts", text.get("num_experts", K3Config.num_experts)):
            if sparse:
                raise ConfigError(f"K3Config.mlp_layer_types: layers {sparse} are 'sparse' but num_experts is 0")
        elif "first_k_dense_replace" in text or "moe_layer_freq" in text:
            first = text.get("first_k_dense_replace", K3Config.first_k_dense_replace)
            freq = text.get("moe_layer_freq", K3Config.moe_layer_freq)
            if not isinstance(first, int) or not isinstance(freq, int) or freq < 1:
                raise ConfigError(f"K3Config.first_k_dense_replace: first_k_dense_replace {first!r} and "
                                  f"moe_layer_freq {freq!r} must be integers (moe_layer_freq >= 1)")
            theirs = _moe_pattern(first, freq, n)
            if theirs != types:
                i = next(i for i in range(n) if theirs[i] != types[i])
                raise ConfigError(f"K3Config.mlp_layer_types: mlp_layer_types[{i}] is {types[i]!r}, but first_k_"
                                  f"dense_replace {first} and moe_layer_freq {freq} make layer {i} {theirs[i]!r}")
        else:  # the first MoE layer and the stride between MoE layers
            first = sparse[0] if sparse else n
            freq = next((f for f in range(1, n + 1) if _moe_pattern(first, f, n) == types), None)
            if freq is None:
                shown = ", ".join(map(str, sparse[:6])) + (", ..." if len(sparse) > 6 else "")
                raise ConfigError(f"K3Config.mlp_layer_types: MoE layers [{shown}] (0-indexed) are not every k-th "
                                  f"layer from the first one on, the only pattern first_k_dense_replace and "
                                  f"moe_layer_freq can express")
            out["first_k_dense_replace"], out["moe_layer_freq"] = first, freq
    return out


def _write_native(cfg: K3Config, text: dict) -> None:
    """Rewrite the native keys a source carried from our fields, so they never go stale."""
    n = cfg.num_hidden_layers
    for key, lk in _NATIVE_LINEAR_KEYS.items():
        if key in text:
            text[key] = getattr(cfg, _LINEAR_ATTN_KEYS[lk])
    for alias, name in _NATIVE_ALIASES.items():
        if alias in text:
            text[alias] = getattr(cfg, name)
    if "layer_types" in text:
        text["layer_types"] = ["full_attention" if cfg.is_mla_layer(i) else "linear_attention" for i in range(n)]
    if "mlp_layer_types" in text:
        text["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(n)]


def default_full_attn_layers(num_layers: int) -> list[int]:
    """K3's schedule (DESIGN §2): MLA every 4th layer (1-indexed 4, 8, ...) plus the final layer."""
    layers = list(range(4, num_layers + 1, 4))
    if num_layers not in layers:
        layers.append(num_layers)
    return layers


# --------------------------------------------------------------------- presets
def preset_config(name: str) -> K3Config:
    """Text preset `name` (k3/configs/<name>.json) as a model, not a file: written out whole, as a
    config built in code is (a checkpoint's config.json has its own token ids in both places)."""
    cfg = K3Config.from_dict(configs.read_preset(name))
    return dataclasses.replace(cfg, _text_source=None, _wrapper_source=None)


# name -> the preset's K3Config (a fresh one per call)
PRESETS = {name: functools.partial(preset_config, name) for name in configs.preset_names()}


def load_config(name_or_path: str | Path) -> K3Config:
    """A preset name (k3, k3-tiny, k3-1b, k3-slice: k3/configs/), a config.json path, or a directory holding one."""
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]()
    path = Path(name_or_path)
    if path.exists():
        return K3Config.from_json(path)
    raise ConfigError(f"unknown preset or missing config path {str(name_or_path)!r}; presets: {', '.join(PRESETS)}")
