"""A Kimi-Linear checkpoint written by transformers 5.24 loads into k3 with the same logits,
whichever config dialect built it: the official fields
(`linear_attn_config`, `first_k_dense_replace`, ...) or transformers' native ones only
(`layer_types`, `mlp_layer_types`, `linear_*`, attribute_map names). The layout tested is not
K3's default schedule (MLA at layers 2 and 5, two dense layers before the MoE ones), so a config
read with the wrong layout cannot load."""
from __future__ import annotations

import json

import pytest
import torch

from k3 import K3ForCausalLM
from tests.helpers import assert_rel_close

transformers = pytest.importorskip("transformers", minversion="5.24")

SIZES = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 2,
         "num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 32, "q_lora_rank": None,
         "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "routed_scaling_factor": 2.446, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DIALECTS = {
    "official": {"num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 2,
                 "mla_use_nope": True,
                 "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [2, 5], "head_dim": 16,
                                        "num_heads": 2, "short_conv_kernel_size": 4}},
    "native": {"num_local_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
               "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"],
               "linear_head_dim": 16, "linear_num_heads": 2, "linear_conv_kernel_dim": 4},
}


def small_kimi_linear(dialect: str = "official"):
    cfg = transformers.KimiLinearConfig(**SIZES, **DIALECTS[dialect])
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # break init symmetries (zero router, unit norms) so every tensor matters
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
            elif "A_log" in name or "dt_bias" in name:
                p.uniform_(-1, 1)
            else:
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.1, 0.1)
    return model


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_transformers_kimi_linear_checkpoint_gives_same_logits(tmp_path, dialect):
    hf = small_kimi_linear(dialect)
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    if dialect == "native":
        assert "linear_attn_config" not in written and "first_k_dense_replace" not in written
    ours = K3ForCausalLM.from_pretrained(tmp_path)
    cfg = ours.config
    assert cfg.gate_lower_bound is None and cfg.attn_res_block_size is None
    assert cfg.full_attn_layers == [2, 5] and (cfg.first_k_dense_replace, cfg.moe_layer_freq) == (2, 1)
    ids = torch.randint(3, 256, (2, 41))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        out = ours(ids)
    assert_rel_close(f"logits vs transformers ({dialect} config)", ref, out, 1e-4)
    # saved again in the official layout, still in step with the config it was read from
    ours.save_pretrained(tmp_path / "again")
    again = K3ForCausalLM.from_pretrained(tmp_path / "again")
    assert again.config == cfg
    with torch.no_grad():
        assert torch.equal(again(ids), out)
