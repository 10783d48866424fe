"""Small whole models and the official tensor names, written out independently of the model code."""
from __future__ import annotations

import torch

from k3.config import K3Config, load_config
from k3.model.transformer import K3ForCausalLM


def small_config(**changes) -> K3Config:
    """k3-tiny shrunk further; still 3:1 KDA:MLA, final MLA, dense layer 0, AttnRes, latent MoE."""
    base = {"hidden_size": 64, "intermediate_size": 128, "kda_head_dim": 16, "kda_num_heads": 2, "num_attention_heads": 2,
                "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "v_head_dim": 16, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
                "routed_expert_hidden_size": 32, "vocab_size": 256, "kda_chunk_size": 16}
    base.update(changes)
    return load_config("k3-tiny").replace(**base)


def randomized(model: K3ForCausalLM) -> K3ForCausalLM:
    """Random AttnRes pseudo-queries and router biases, so tests exercise more than the init state."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model.eval()


def official_names(cfg) -> set[str]:
    """The official tensor names written out from DESIGN §3-6, independently of the model code."""
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
