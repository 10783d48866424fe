"""`k3 quantize`: dense checkpoint -> packed layout + per-layer error report."""
from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoint.official import save_pretrained
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.quantize_cli import REPORT_FILE
from k3.cli import main
from k3.model.transformer import K3ForCausalLM
from tests.helpers.models import randomized, small_config


def _quantize(src, out) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--model", str(src), "--out", str(out)])
    return exit_info.value.code


def test_quantize_verb(tmp_path, capsys):
    model = randomized(K3ForCausalLM(small_config()))
    save_pretrained(model, tmp_path / "dense")
    (tmp_path / "dense" / "tokenizer.json").write_text("{}")
    assert _quantize(tmp_path / "dense", tmp_path / "mx") == 0
    printed = capsys.readouterr().out
    assert "MXFP4 relative error" in printed and "wrote" in printed
    assert (tmp_path / "mx" / "tokenizer.json").is_file()

    rows = json.loads((tmp_path / "mx" / REPORT_FILE).read_text())
    moe_layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    assert [r["layer"] for r in rows] == moe_layers + ["all"]
    for r in rows:
        assert 0.05 < r["w1"] < 0.2 and 0.05 < r["w2"] < 0.2 and 0.05 < r["w3"] < 0.2, r
        assert r["worst"] >= max(r["w1"], r["w2"], r["w3"]) - 1e-12
    assert rows[-1]["experts"] == len(moe_layers) * model.config.num_experts

    loaded = load_pretrained(tmp_path / "mx").eval()
    assert torch.isfinite(loaded(torch.randint(0, 256, (1, 8)))).all()

    # refusals: an already packed input, a non-empty output
    assert _quantize(tmp_path / "mx", tmp_path / "again") == 2
    assert _quantize(tmp_path / "dense", tmp_path / "mx") == 2
    err = capsys.readouterr().err
    assert "k3 quantize: error: " in err and "already quantized" in err
    # a write that fails leaves neither the output nor a temp folder behind
    (tmp_path / "blocked").write_text("a file where the output's parent should be")
    assert _quantize(tmp_path / "dense", tmp_path / "blocked" / "mx") == 2
    assert "cannot write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocked", "dense", "mx"]


def test_expert_dims_not_multiples_of_32_are_a_one_line_error(tmp_path, capsys):
    """MXFP4 scales blocks of 32 along a matrix's input dim: w2 [32, 48] cannot be packed."""
    save_pretrained(K3ForCausalLM(small_config(moe_intermediate_size=48)), tmp_path / "dense")
    assert _quantize(tmp_path / "dense", tmp_path / "mx") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("k3: ")]
    assert len(err) == 1 and err[0].startswith("k3 quantize: error: language_model.model.layers.1.block_sparse_moe."
                                               "experts.0.w2.weight (32, 48): its input dim 48 is not a multiple of 32")
    assert not (tmp_path / "mx").exists()


def test_quantize_keeps_a_multimodal_checkpoints_vision_tower(tmp_path, capsys):
    """The published K3 checkpoint is multimodal and packed: `k3 quantize` of a multimodal folder
    packs the text model's routed experts and keeps the tower and projector (bf16, as the published
    quantization_config ignores them) instead of dropping them with the text loader."""
    from k3.checkpoint.files import INDEX_NAME
    from k3.checkpoint.multimodal import load_pretrained_multimodal, save_pretrained_multimodal
    from tests.checkpoint.test_multimodal_checkpoint import inputs, tiny_multimodal, vision_names

    model = tiny_multimodal()
    save_pretrained_multimodal(model, tmp_path / "dense")
    assert _quantize(tmp_path / "dense", tmp_path / "mx") == 0
    assert "vision tower and projector bf16" in capsys.readouterr().out
    names = set(json.loads((tmp_path / "mx" / INDEX_NAME).read_text())["weight_map"])
    assert vision_names(model.config.vision_config) <= names
    assert any(n.endswith("experts.0.w1.weight_packed") for n in names)
    assert not any(n.endswith("experts.0.w1.weight") for n in names)
    config = json.loads((tmp_path / "mx" / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and "vision_config" in config
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"

    loaded = load_pretrained_multimodal(tmp_path / "mx", dtype=torch.float32).eval()
    for name, p in model.named_parameters():
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(loaded.get_parameter(name), p.detach().to(torch.bfloat16).float()), name
    with torch.no_grad():
        assert torch.isfinite(loaded(*inputs(loaded))).all()
