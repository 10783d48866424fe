"""The official multimodal layout: K3ForConditionalGeneration saved sharded with an index
under exactly the published names (`language_model.*`, `vision_tower.*`, `mm_projector.*`), read
back equal; strict keys; the text loader reads the same folder; the config.json it writes."""
from __future__ import annotations

import json

import pytest
import torch

from k3.checkpoint.files import INDEX_NAME, CheckpointError
from k3.checkpoint.multimodal import load_pretrained_multimodal, multimodal_to_official, save_pretrained_multimodal
from k3.checkpoint.official import save_pretrained
from k3.checkpoint.pretrained import load_pretrained
from k3.config import load_config
from k3.model.multimodal import K3ForConditionalGeneration, K3MultimodalConfig
from k3.model.transformer import K3ForCausalLM
from tests.helpers import assert_rel_close
from tests.helpers.models import official_names, randomized, small_config
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.model.vision.helpers import pixels, tiny_config

GRIDS = [(1, 4, 6), (2, 4, 4)]  # an image and a 2-frame clip (the clip reads the temporal table)
ROWS = 6 + 4


def tiny_multimodal(seed: int = 0) -> K3ForConditionalGeneration:
    text = small_config()
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(K3MultimodalConfig(text, tiny_config(text_hidden_size=text.hidden_size)))
    randomized(model.language_model)
    return model.eval()


def vision_names(cfg) -> set[str]:
    """The official vision tensor names (moonshotai/Kimi-K3 `modeling_kimi_k3.py`), written out."""
    names = {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
             "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
             "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"}
    for i in range(cfg.vt_num_hidden_layers):
        names |= {f"vision_tower.encoder.blocks.{i}.{m}.weight"
                  for m in ("norm0", "wqkv", "wo", "norm1", "mlp.fc0", "mlp.fc1")}
    return names


def inputs(model):
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    token = model.config.media_placeholder_token_id
    ids = torch.tensor([[7, 8] + [token] * 6 + [9] + [token] * 4 + [10, 11]])
    return ids, px, g


def test_round_trip_is_identical_and_names_are_official(tmp_path):
    model = tiny_multimodal()
    save_pretrained_multimodal(model, tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    names = set(index["weight_map"])
    assert names == official_names(model.config.text_config) | vision_names(model.config.vision_config)
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and shards == {p.name for p in tmp_path.glob("*.safetensors")}
    assert not list(tmp_path.glob("*.tmp*"))

    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["KimiK3ForConditionalGeneration"] and written["model_type"] == "kimi_k3"
    assert written["vision_config"] == model.config.vision_config.to_dict()
    assert written["text_config"] == model.config.text_config.to_dict()["text_config"]

    loaded = load_pretrained_multimodal(tmp_path).eval()
    assert loaded.config.to_dict() == model.config.to_dict()
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    ids, px, g = inputs(model)
    with torch.no_grad():
        # identical tensors; logits agree to fp32 rounding (differently aligned buffers may pick
        # another BLAS kernel, as in tests/checkpoint/test_official.py)
        assert_rel_close("logits after reload", model(ids, px, g), loaded(ids, px, g), 1e-6)


def test_text_loader_reads_the_multimodal_folder(tmp_path):
    model = tiny_multimodal()
    save_pretrained_multimodal(model, tmp_path, max_shard_bytes=100_000)
    text = load_pretrained(tmp_path)  # skips vision_tower. / mm_projector.
    assert isinstance(text, K3ForCausalLM)
    ref = model.language_model.state_dict()
    assert ref.keys() == text.state_dict().keys()
    assert all(torch.equal(ref[n], t) for n, t in text.state_dict().items())


def test_strict_keys_are_one_line_errors(tmp_path):
    model = tiny_multimodal()
    tensors = multimodal_to_official(model)
    config_dict = model.config.to_dict()
    for change, needle in [("drop", "missing ['mm_projector.post_norm.weight']"),
                           ("add", "unexpected ['vision_tower.extra.weight']")]:
        bad = dict(tensors)
        if change == "drop":
            del bad["mm_projector.post_norm.weight"]
        else:
            bad["vision_tower.extra.weight"] = torch.zeros(2)
        folder = tmp_path / change
        save_pretrained(model.language_model, folder, tensors=bad, config_dict=config_dict)
        with pytest.raises(CheckpointError) as err:
            load_pretrained_multimodal(folder)
        assert needle in str(err.value) and "\n" not in str(err.value)

    text_only = tmp_path / "text"
    save_pretrained(model.language_model, text_only, config_dict=config_dict)
    with pytest.raises(CheckpointError, match="has no vision_tower. / mm_projector. tensors"):
        load_pretrained_multimodal(text_only)


def test_load_in_bf16_keeps_fp32_tensors_and_computes_the_temporal_table(tmp_path):
    model = tiny_multimodal()
    save_pretrained_multimodal(model, tmp_path)
    loaded = load_pretrained_multimodal(tmp_path, dtype=torch.bfloat16)
    state = loaded.state_dict()
    assert state["vision_tower.encoder.blocks.0.wqkv.weight"].dtype == torch.bfloat16
    assert state["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    table = loaded.vision_tower.patch_embed.pos_emb.time_weight
    assert torch.equal(table, model.vision_tower.patch_embed.pos_emb.time_weight)
    ids, px, g = inputs(model)
    with torch.no_grad():
        # bf16 weights and activations through every layer: a sanity bound, not a precision claim
        assert_rel_close("bf16 logits", model(ids, px, g), loaded(ids, px, g), 6e-2)


def test_published_placeholder_id_and_tiny_vocabulary_config_json(tmp_path):
    """A config.json written from presets (no published source) reads back to the same model config."""
    text = load_config("k3-tiny")
    cfg = K3MultimodalConfig(text, tiny_config(text_hidden_size=text.hidden_size), media_placeholder_token_id=4000)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    again = K3MultimodalConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert again.to_dict() == cfg.to_dict() and again.media_placeholder_token_id == 4000
    assert again.vision_config == cfg.vision_config and again.text_config == cfg.text_config


def test_from_k3_import_with_from_pretrained(tmp_path):
    """`from k3 import K3ForConditionalGeneration`: the model's class, loading and saving the
    official three-prefix layout."""
    import k3

    assert k3.K3ForConditionalGeneration is K3ForConditionalGeneration
    model = tiny_multimodal(seed=1)
    model.save_pretrained(tmp_path, max_shard_bytes=100_000)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["KimiK3ForConditionalGeneration"]
    loaded = k3.K3ForConditionalGeneration.from_pretrained(tmp_path, dtype="auto")
    assert type(loaded) is K3ForConditionalGeneration and not loaded.training
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
