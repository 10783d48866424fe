"""The official MXFP4 packed layout (DESIGN §1, §9)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from k3.checkpoint.files import INDEX_NAME
from k3.checkpoint.official import state_dict_to_official
from k3.checkpoint.packed import QUANTIZATION_CONFIG, PackedCheckpointError, save_packed, unpack_tensors
from k3.checkpoint.pretrained import load_pretrained
from k3.config import K3Config
from k3.model.experts import RoutedExperts
from k3.model.transformer import K3ForCausalLM
from k3.quant.mx import E2M1, fake_quantize
from k3.quant.targets import is_routed_expert_linear
from tests.helpers import K3_CONFIG_JSON, rel_err
from tests.helpers.models import official_names, randomized, small_config

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def with_quantized_experts(model: K3ForCausalLM) -> K3ForCausalLM:
    """The same model with every routed-expert weight replaced by its MXFP4 (K3 ceil rule) value."""
    out = randomized(K3ForCausalLM(model.config))
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        for module in out.modules():
            if isinstance(module, RoutedExperts):
                for w in (module.w1, module.w3, module.w2):  # [E, out, in]: blocks run along `in`
                    w.copy_(fake_quantize(w, E2M1, "ceil"))
    return out.eval()


def test_published_quantization_config_matches_fixture():
    published = json.loads(K3_CONFIG_JSON.read_text())["text_config"]["quantization_config"]
    assert QUANTIZATION_CONFIG == published


def test_targets_are_routed_experts_only():
    assert is_routed_expert_linear("model.layers.3.block_sparse_moe.experts.17.w2")
    for name in ("model.layers.3.block_sparse_moe.shared_experts.down_proj", "model.layers.0.mlp.gate_proj",
                 "model.layers.3.block_sparse_moe.routed_expert_down_proj", "model.layers.3.block_sparse_moe.gate",
                 "model.layers.3.self_attn.q_proj", "lm_head"):
        assert not is_routed_expert_linear(name), name


def test_round_trip_tiny_model(tmp_path):
    torch.manual_seed(0)
    model = randomized(K3ForCausalLM(small_config()))
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    ref = model(ids)

    save_packed(model, tmp_path / "exact", dtype=None, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "exact" / INDEX_NAME).read_text())
    names = set(index["weight_map"])
    dense = official_names(model.config)
    experts = {n for n in dense if is_routed_expert_linear(n.removesuffix(".weight"))}
    assert experts, "the model has routed experts"
    assert names == (dense - experts) | {n.replace(".weight", s) for n in experts
                                         for s in (".weight_packed", ".weight_scale")}
    config = json.loads((tmp_path / "exact" / "config.json").read_text())
    assert config["text_config"]["quantization_config"] == QUANTIZATION_CONFIG

    # exactly the quantized weights: logits bit-identical to the model with fake-quantized experts
    loaded = load_pretrained(tmp_path / "exact").eval()
    assert torch.equal(loaded(ids), with_quantized_experts(model)(ids))
    assert "quantization_config" not in loaded.config.to_dict()["text_config"], "the loaded model is dense"

    # and within the error the format implies: no worse than the worst expert weight's own MXFP4 error
    weight_err = max(rel_err(w, fake_quantize(w, E2M1, "ceil")) for n, w in state_dict_to_official(model).items()
                     if is_routed_expert_linear(n.removesuffix(".weight")))
    assert 0.05 < weight_err < 0.2  # E2M1 on Gaussian weights
    assert rel_err(ref, loaded(ids)) <= weight_err

    # the published form: bf16 everywhere else
    save_packed(model, tmp_path / "bf16")
    bf16 = load_pretrained(tmp_path / "bf16").eval()
    emb = bf16.model.embed_tokens.weight
    assert emb.dtype == torch.bfloat16
    assert bf16.model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32  # router pinned fp32
    assert rel_err(ref, bf16(ids)) <= weight_err


def _official_config() -> K3Config:
    """The published config.json (wrapper, quantization_config and all) with tiny sizes."""
    raw = json.loads(K3_CONFIG_JSON.read_text())
    small = small_config().to_dict()["text_config"]
    text = raw["text_config"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
                "vocab_size", "attn_res_block_size"):
        text[key] = small[key]
    text["moe_intermediate_size"] = 2 * text["routed_expert_hidden_size"]  # non-square experts: orientation shows
    la = text["linear_attn_config"]
    la.update(head_dim=small["linear_attn_config"]["head_dim"], num_heads=small["linear_attn_config"]["num_heads"],
              kda_layers=small["linear_attn_config"]["kda_layers"],
              full_attn_layers=small["linear_attn_config"]["full_attn_layers"])
    return raw


def test_official_layout_loads(tmp_path):
    """A checkpoint written by hand from the published names and shapes loads, and its experts
    dequantize to the values a by-hand E2M1 x 2^(code - 127) decode gives."""
    raw = _official_config()
    raw_no_qc = json.loads(json.dumps(raw))
    del raw_no_qc["text_config"]["quantization_config"]
    cfg = K3Config.from_dict(raw_no_qc)
    assert cfg.checkpoint_prefix == "language_model."
    with torch.device("meta"):
        shapes = {cfg.checkpoint_prefix + n: t.shape for n, t in K3ForCausalLM(cfg).state_dict().items()}
    L, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in sorted(official_names(cfg)):
        module = name.removesuffix(".weight")
        if is_routed_expert_linear(module):
            out_f, in_f = (L, inter) if module.endswith("w2") else (inter, L)  # w1/w3: L -> I, w2: I -> L
            tensors[module + ".weight_packed"] = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8, generator=g)
            tensors[module + ".weight_scale"] = torch.randint(118, 125, (out_f, in_f // 32), dtype=torch.uint8, generator=g)
        elif name.endswith(("A_log", "e_score_correction_bias", "dt_bias")):
            tensors[name] = torch.randn(shapes[name], generator=g) * 0.1
        else:
            tensors[name] = (torch.randn(shapes[name], generator=g) * 0.05).to(torch.bfloat16)
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3, dtype=torch.bfloat16)  # ignored part
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (tmp_path / INDEX_NAME).write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))
    (tmp_path / "config.json").write_text(json.dumps(raw))

    model = load_pretrained(tmp_path).eval()
    expert = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"
    packed, scale = tensors[expert + ".weight_packed"], tensors[expert + ".weight_scale"]
    w = model.model.layers[1].block_sparse_moe.experts.w2[3]
    assert w.shape == (L, inter) and w.dtype == torch.bfloat16
    for row, col in [(0, 0), (0, 1), (5, 33), (L - 1, inter - 2), (L - 1, inter - 1)]:
        nibble = (packed[row, col // 2].item() >> (4 * (col % 2))) & 0xF  # even column: low nibble
        value = (-1 if nibble & 8 else 1) * E2M1_VALUES[nibble & 7] * 2.0 ** (scale[row, col // 32].item() - 127)
        assert w[row, col].item() == value, (row, col)
    assert torch.isfinite(model(torch.randint(0, cfg.vocab_size, (1, 12)))).all()


def test_bad_packed_tensors():
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(PackedCheckpointError, match="has no"):
        unpack_tensors({"a.weight_packed": packed}, torch.float32)
    with pytest.raises(PackedCheckpointError, match="disagree"):
        unpack_tensors({"a.weight_packed": packed, "a.weight_scale": torch.zeros(4, 2, dtype=torch.uint8)}, torch.float32)


def test_load_rejects_other_formats(tmp_path):
    model = K3ForCausalLM(small_config())
    save_packed(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PackedCheckpointError, match="unsupported quantization_config"):
        load_pretrained(tmp_path)
