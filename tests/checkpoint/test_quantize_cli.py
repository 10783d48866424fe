"""`k3 quantize` (issue #6, tooling): dense checkpoint -> packed layout + per-layer error report."""
from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoint.official import load_pretrained, save_pretrained
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


def test_expert_dims_not_multiples_of_32_are_a_one_line_error(tmp_path, capsys):
    """MXFP4 scales blocks of 32 along a matrix's input dim: w2 [32, 48] cannot be packed (issue #20)."""
    save_pretrained(K3ForCausalLM(small_config(moe_intermediate_size=48)), tmp_path / "dense")
    assert _quantize(tmp_path / "dense", tmp_path / "mx") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("k3: ")]
    assert len(err) == 1 and err[0].startswith("k3 quantize: error: language_model.model.layers.1.block_sparse_moe."
                                               "experts.0.w2.weight (32, 48): its input dim 48 is not a multiple of 32")
    assert not (tmp_path / "mx").exists()
