import json

import pytest

from k3.config import PRESETS, ConfigError, K3Config, load_config
from tests.helpers import K3_CONFIG_JSON, KIMI_LINEAR_CONFIG_JSON


@pytest.mark.parametrize("path", [K3_CONFIG_JSON, KIMI_LINEAR_CONFIG_JSON], ids=["k3", "kimi-linear"])
def test_official_config_round_trips_losslessly(path, tmp_path):
    published = json.loads(path.read_text())
    cfg = K3Config.from_json(path)
    assert cfg.to_dict() == published
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
    (dict(gate_lower_bound=-6.0), "gate_lower_bound"),
    (dict(gate_lower_bound=0.0), "gate_lower_bound"),
    (dict(kda_layers=[1, 2, 3], full_attn_layers=[4]), "linear_attn_config"),
    (dict(num_experts_per_token=99), "num_experts_per_token"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_invalid_config_names_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        load_config("k3-tiny").replace(**changes)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("k3-huge")
