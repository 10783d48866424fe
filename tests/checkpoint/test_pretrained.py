"""The transformers-style API: `from k3 import K3ForCausalLM`, `from_pretrained` over
every layout the one loader reads (ours, the official K3 layout single-file and sharded beside the
vision tensors, MXFP4-packed; Kimi-Linear written by transformers is tests/model/test_hf_parity.py),
`save_pretrained` writing the official layout, and `import k3` staying free of torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import k3
from k3 import K3Cache, K3Config, K3ForCausalLM, generate
from k3.checkpoint.files import INDEX_NAME
from k3.checkpoint.official import state_dict_to_official
from k3.checkpoint.packed import save_packed
from tests.helpers import assert_rel_close
from tests.helpers.models import official_names, randomized, small_config


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return randomized(K3ForCausalLM(small_config()))


def logits(m, ids) -> torch.Tensor:
    with torch.no_grad():
        return m(ids)


IDS = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))


def test_public_names():
    assert isinstance(small_config(), K3Config) and k3.K3Cache is K3Cache and callable(generate)
    assert K3ForCausalLM is k3.model.K3ForCausalLM  # one class: the model's, its format registered
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        k3.nothing  # noqa: B018
    # `k3 VERB` imports k3 before it sets the CPU threads, which must precede torch
    code = "import sys, k3; assert 'torch' not in sys.modules, 'import k3 loaded torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_save_pretrained_round_trip(model, tmp_path):
    out = model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == official_names(model.config)  # the official layout and names
    assert all(n.startswith("language_model.") for n in index["weight_map"])
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is K3ForCausalLM and not loaded.training
    assert_rel_close("ours", logits(model, IDS), logits(loaded, IDS), 1e-6)
    half = K3ForCausalLM.from_pretrained(tmp_path, dtype="bfloat16", device="cpu")
    assert half.lm_head.weight.dtype == torch.bfloat16


def test_official_single_file(model, tmp_path):
    """One model.safetensors without an index, as a small official repo ships it."""
    tensors = {n: t.contiguous() for n, t in state_dict_to_official(model).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert_rel_close("official single file", logits(model, IDS), logits(K3ForCausalLM.from_pretrained(tmp_path), IDS),
                     1e-6)


def test_official_sharded_with_vision_tensors(model, tmp_path):
    """Shards + index with the official vision encoder's tensors beside: a text model skips them."""
    model.save_pretrained(tmp_path, max_shard_bytes=100_000)
    vision = {"vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(12, 4),
              "vision_tower.patch_embed.proj.weight": torch.randn(4, 3, 2, 2),
              "mm_projector.proj.0.weight": torch.randn(8, 16), "mm_projector.pre_norm.weight": torch.ones(16)}
    fname = "model-vision.safetensors"
    save_file(vision, str(tmp_path / fname))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 2
    index["weight_map"].update({name: fname for name in vision})
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    assert_rel_close("official sharded", logits(model, IDS), logits(K3ForCausalLM.from_pretrained(tmp_path), IDS),
                     1e-6)


def test_mxfp4_packed_and_run_folder(model, tmp_path):
    save_packed(model, tmp_path / "run" / "checkpoints" / "step_0000007", dtype=None)
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "run")  # a run folder: its latest checkpoint
    experts = loaded.model.layers[1].block_sparse_moe.experts.w1
    dense = model.model.layers[1].block_sparse_moe.experts.w1
    assert experts.dtype == torch.float32 and not torch.equal(experts, dense)  # MXFP4 values, dequantized
    assert torch.isfinite(logits(loaded, IDS)).all()
    assert_rel_close("dense part unchanged", model.lm_head.weight, loaded.lm_head.weight, 0.0)


def test_one_class_per_public_model_name():
    """`class K3ForCausalLM` / `class K3ForConditionalGeneration` each once in k3, and a class no
    checkpoint format registered says how to get one."""
    from pathlib import Path

    from k3.model.pretrained import Pretrained

    src = [p.read_text() for p in Path(k3.__file__).parent.rglob("*.py")]
    for name in ("K3ForCausalLM", "K3ForConditionalGeneration"):
        assert sum(text.count(f"\nclass {name}(") for text in src) == 1, name

    class Unregistered(Pretrained):
        pass

    with pytest.raises(RuntimeError, match="from k3 import Unregistered"):
        Unregistered.from_pretrained("anywhere")
