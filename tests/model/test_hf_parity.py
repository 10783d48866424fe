"""A Kimi-Linear checkpoint written by transformers 5.24 loads into k3 with the same logits
(issue #2, acceptance 8)."""
from __future__ import annotations

import pytest
import torch

from k3.checkpoint.official import load_pretrained
from tests.helpers import assert_rel_close

transformers = pytest.importorskip("transformers", minversion="5.24")


def small_kimi_linear():
    cfg = transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=128, moe_intermediate_size=32, num_experts=6, num_experts_per_token=2,
        num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, routed_scaling_factor=2.446,
        linear_attn_config={"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
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


def test_transformers_kimi_linear_checkpoint_gives_same_logits(tmp_path):
    hf = small_kimi_linear()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    assert ours.config.gate_lower_bound is None and ours.config.attn_res_block_size is None
    ids = torch.randint(3, 256, (2, 41))
    with torch.no_grad():
        ref = hf(ids).logits.float()
        out = ours(ids)
    assert_rel_close("logits vs transformers", ref, out, 1e-4)
