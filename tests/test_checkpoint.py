"""HF-layout checkpoints (issue #2, acceptance 9): round trip and the official tensor names."""
from __future__ import annotations

import json

import pytest
import torch

from k3.model.checkpoint import INDEX_NAME, load_pretrained, save_pretrained
from k3.model.transformer import K3ForCausalLM
from tests.conftest import assert_rel_close
from tests.test_model import randomized, small_config


def official_names(cfg) -> set[str]:
    """The official tensor names written out from SPEC §3-6, independently of the model code."""
    p = cfg.checkpoint_prefix + "model."
    names = {p + "embed_tokens.weight", p + "norm.weight", cfg.checkpoint_prefix + "lm_head.weight"}
    if cfg.attn_res_block_size:
        names |= {p + "output_attn_res_proj.weight", p + "output_attn_res_norm.weight"}
    for i in range(cfg.num_hidden_layers):
        L = f"{p}layers.{i}."
        names |= {L + "input_layernorm.weight", L + "post_attention_layernorm.weight"}
        if cfg.attn_res_block_size:
            names |= {L + s for s in ("self_attention_res_proj.weight", "self_attention_res_norm.weight",
                                      "mlp_res_proj.weight", "mlp_res_norm.weight")}
        a = L + "self_attn."
        if cfg.is_mla_layer(i):
            q = ["q_a_proj", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
            names |= {a + m + ".weight" for m in q + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "g_proj",
                                                      "kv_a_layernorm"] + (["q_a_layernorm"] if cfg.q_lora_rank else [])}
        else:
            gate = ["g_proj"] if cfg.use_full_rank_gate else ["g_a_proj", "g_b_proj"]
            names |= {a + m + ".weight" for m in ["q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d",
                                                  "b_proj", "f_a_proj", "f_b_proj", "o_norm", "o_proj"] + gate}
            names |= {a + "A_log", a + "dt_bias"}
        if cfg.is_moe_layer(i):
            m = L + "block_sparse_moe."
            names |= {m + "gate.weight", m + "gate.e_score_correction_bias"}
            names |= {f"{m}experts.{e}.{w}.weight" for e in range(cfg.num_experts) for w in ("w1", "w2", "w3")}
            names |= {m + f"shared_experts.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
            if cfg.routed_expert_hidden_size:
                names |= {m + "routed_expert_down_proj.weight", m + "routed_expert_up_proj.weight",
                          m + "routed_expert_norm.weight"}
        else:
            names |= {L + f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
    return names


def test_round_trip_is_identical_and_names_are_official(tmp_path):
    torch.manual_seed(0)
    model = randomized(K3ForCausalLM(small_config()))
    save_pretrained(model, tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == official_names(model.config)
    assert len(set(index["weight_map"].values())) > 1, "sharding exercised"
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_pretrained(tmp_path)
    ref = model.state_dict()
    got = loaded.state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    ids = torch.randint(0, 256, (1, 10))
    # identical tensors; logits agree to fp32 rounding (BLAS may pick another kernel for the
    # differently aligned buffers that safetensors hands back)
    assert_rel_close("logits after reload", model(ids), loaded.eval()(ids), 1e-6)


def test_load_rejects_mismatched_checkpoint(tmp_path):
    save_pretrained(K3ForCausalLM(small_config()), tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint shape \(8, 64\) != model shape \(4, 64\)"):
        load_pretrained(tmp_path, config=small_config(num_experts=4))
    with pytest.raises(KeyError, match=r"does not match the config: .*unexpected \['model.layers.0.mlp_res_norm"):
        load_pretrained(tmp_path, config=small_config(attn_res_block_size=None))
