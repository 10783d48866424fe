"""HF-layout checkpoints: round trip and the official tensor names."""
from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoint.files import INDEX_NAME
from k3.checkpoint.official import save_pretrained
from k3.checkpoint.pretrained import load_pretrained
from k3.model.transformer import K3ForCausalLM
from tests.helpers import assert_rel_close
from tests.helpers.models import official_names, randomized, small_config


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
