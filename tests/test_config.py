import json
import re

import pytest

from k3.cli import main
from k3.config import PRESETS, ConfigError, K3Config, load_config
from tests.helpers import K3_CONFIG_JSON, KIMI_LINEAR_CONFIG_JSON


@pytest.mark.parametrize("path", [K3_CONFIG_JSON, KIMI_LINEAR_CONFIG_JSON], ids=["k3", "kimi-linear"])
def test_official_config_round_trips_losslessly(path, tmp_path):
    published = json.loads(path.read_text())
    cfg = K3Config.from_json(path)
    assert cfg.to_dict() == published
    assert list(cfg.to_dict()) == list(published)  # the published key order too (text_config in place)
    cfg.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == published


def test_official_k3_schedule():
    cfg = K3Config.from_json(K3_CONFIG_JSON)
    assert (cfg.num_kda_layers, cfg.num_mla_layers) == (69, 24)
    assert cfg.is_mla_layer(92) and cfg.is_mla_layer(3) and not cfg.is_mla_layer(0)
    assert cfg.gate_lower_bound == -5.0 and cfg.use_full_rank_gate and cfg.hidden_act == "situ"
    assert cfg.checkpoint_prefix == "language_model."


def test_kimi_linear_absent_keys_mean_kimi_linear_architecture():
    cfg = K3Config.from_json(KIMI_LINEAR_CONFIG_JSON)
    assert cfg.gate_lower_bound is None and not cfg.use_full_rank_gate
    assert cfg.attn_res_block_size is None and cfg.routed_expert_hidden_size is None
    assert cfg.q_lora_rank is None and cfg.checkpoint_prefix == ""


def test_k3_preset_equals_published_config():
    preset, published = load_config("k3"), K3Config.from_json(K3_CONFIG_JSON)
    assert preset == published


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_keep_k3_structure(name):
    cfg = load_config(name)
    assert cfg.is_mla_layer(cfg.num_hidden_layers - 1), "final layer is MLA"
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1), "dense layer 0, MoE after"
    assert cfg.num_kda_layers >= 2 * cfg.num_mla_layers
    assert K3Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("changes, field", [
    ({"gate_lower_bound": -6.0}, "gate_lower_bound"),
    ({"gate_lower_bound": 0.0}, "gate_lower_bound"),
    ({"kda_layers": [1, 2, 3], "full_attn_layers": [4]}, "linear_attn_config"),
    ({"num_experts_per_token": 99}, "num_experts_per_token"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_invalid_config_names_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        load_config("k3-tiny").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("k3-huge")


# ------------------------------------------------------------- transformers' native dialect
def _kimi_linear() -> dict:
    return json.loads(KIMI_LINEAR_CONFIG_JSON.read_text())


def _native(d: dict) -> dict:
    """The published Kimi-Linear config in transformers' own fields only (what KimiLinearConfig writes)."""
    la, n = d.pop("linear_attn_config"), d["num_hidden_layers"]
    d["layer_types"] = ["full_attention" if i + 1 in la["full_attn_layers"] else "linear_attention" for i in range(n)]
    first = d.pop("first_k_dense_replace")
    d["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(n)]
    d.pop("moe_layer_freq")
    d.update(linear_head_dim=la["head_dim"], linear_num_heads=la["num_heads"],
             linear_conv_kernel_dim=la["short_conv_kernel_size"], num_local_experts=d.pop("num_experts"))
    return d


def test_native_dialect_reads_as_the_official_one(tmp_path):
    official = K3Config.from_json(KIMI_LINEAR_CONFIG_JSON)
    native = K3Config.from_dict(_native(_kimi_linear()))
    assert native == official
    both = {**_kimi_linear(), **{k: v for k, v in _native(_kimi_linear()).items() if k != "num_local_experts"}}
    assert K3Config.from_dict(both) == official  # both dialects, agreeing
    # written back, the native keys follow a changed field instead of contradicting it
    changed = native.replace(full_attn_layers=[4, 27], kda_layers=[i for i in range(1, 28) if i not in (4, 27)],
                             kda_head_dim=64, num_experts=32, first_k_dense_replace=3)
    again = changed.to_dict()
    assert again["layer_types"].count("full_attention") == 2 and again["linear_head_dim"] == 64
    assert again["mlp_layer_types"][:4] == ["dense"] * 3 + ["sparse"] and again["num_local_experts"] == 32
    assert K3Config.from_dict(again) == changed


def _set(**kw):
    return lambda d: {**d, **kw}


def _drop_layout(d: dict, **kw) -> dict:
    d = {k: v for k, v in d.items() if k not in ("first_k_dense_replace", "moe_layer_freq")}
    return {**d, **kw}


N = 27
LINEAR = ["linear_attention"] * N
BAD_LAYOUTS = {  # id: (change to the published config, the field the one-line error names)
    "layer_types-length": (_set(layer_types=LINEAR[:-1]), "layer_types: has 26 entries, num_hidden_layers is 27"),
    "layer_types-value": (_set(layer_types=["attention"] * N), "layer_types: must be a list of"),
    "layer_types-not-a-list": (_set(layer_types="linear_attention"), "layer_types: must be a list of"),
    "layer_types-vs-linear_attn_config": (_set(layer_types=LINEAR), (
        "layer_types: contradicts linear_attn_config.kda_layers, which omits layer 4 (1-indexed): "
        "layer_types[3] is 'linear_attention'")),
    "linear_head_dim-vs-linear_attn_config": (_set(linear_head_dim=64), (
        "linear_head_dim: linear_head_dim 64 and linear_attn_config.head_dim 128 disagree")),
    "mlp_layer_types-vs-first_k_dense_replace": (_set(mlp_layer_types=["sparse"] * N), (
        "mlp_layer_types: mlp_layer_types[0] is 'sparse', but first_k_dense_replace 1 and moe_layer_freq 1 "
        "make layer 0 'dense'")),
    "mlp_layer_types-inexpressible": (lambda d: _drop_layout(d, mlp_layer_types=["dense", "sparse"] * 13 + ["dense"]),
                                      "mlp_layer_types: MoE layers [1, 3, 5"),
    "alias-vs-field": (_set(num_local_experts=8), "num_experts: num_experts 256 and num_local_experts 8 disagree"),
    "linear_attn_config-not-an-object": (_set(linear_attn_config=[4, 8]), "linear_attn_config: "),
    "linear_attn_config-out-of-range": (_set(linear_attn_config={**_kimi_linear()["linear_attn_config"],
                                                                 "full_attn_layers": [4, 8, 12, 16, 20, 24, 28]}),
                                        "linear_attn_config: kda_layers + full_attn_layers"),
}


@pytest.mark.parametrize("change,message", list(BAD_LAYOUTS.values()), ids=list(BAD_LAYOUTS))
def test_bad_layout_config_is_a_one_line_error_naming_the_field(tmp_path, capsys, change, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        K3Config.from_dict(change(_kimi_linear()))
    assert "\n" not in str(info.value)
    # through a verb: exit status 2 and one line, no traceback
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(change(_kimi_linear())))
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("k3: ")]  # the CPU-thread note
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"k3 quantize: error: {tmp_path / 'ckpt' / 'config.json'}: K3Config.")
    assert message in lines[0]
