"""K3ForConditionalGeneration (DESIGN §7; docs/VISION.md): image rows replace the placeholder tokens'
embeddings in order, text positions are the text model's own, a placeholder/row mismatch is a clear
error, a text-only call never runs the tower and is K3ForCausalLM's call bit for bit; the
`inputs_embeds` seam of K3ForCausalLM; the published config builds on meta and `k3 params` prints
its vision counts."""
from __future__ import annotations

import json

import pytest
import torch

from k3.cli import main
from k3.config import ConfigError, load_config
from k3.model.cache import K3Cache
from k3.model.multimodal import K3ForConditionalGeneration, K3MultimodalConfig, placeholder_count
from k3.model.params import count_parameters
from k3.model.transformer import K3ForCausalLM
from tests.helpers import K3_CONFIG_JSON, assert_rel_close
from tests.helpers.models import randomized
from tests.model.vision.helpers import pixels, tiny_config

# an image smaller than the 8 x 8 table, a 1-row image, and a 2-frame clip (frames pool to one)
GRIDS = [(1, 4, 6), (1, 2, 2), (2, 4, 4)]
ROWS = [6, 1, 4]  # (h / 2) * (w / 2), written out


def tiny_multimodal(seed: int = 0, **text_changes) -> K3ForConditionalGeneration:
    """k3-tiny text + a 2-layer vision tower projecting to the text width; the official placeholder
    id 163605, outside the tiny 4096-token vocabulary (the wrapper must never look it up)."""
    text = load_config("k3-tiny").replace(**text_changes)
    torch.manual_seed(seed)
    model = K3ForConditionalGeneration(K3MultimodalConfig(text, tiny_config(text_hidden_size=text.hidden_size)))
    randomized(model.language_model)
    return model.eval()


def prompt(model, rows_per_row: list[list[int]], seed: int = 2) -> tuple[torch.Tensor, list[list[int]]]:
    """input_ids [B, T]: per batch row, text then each image's placeholders then text; and the
    placeholder positions of each image, in image order."""
    gen = torch.Generator().manual_seed(seed)
    token = model.config.media_placeholder_token_id
    rows, blocks = [], []
    for images in rows_per_row:
        ids = []
        for n in images:
            ids += torch.randint(3, 4096, (2,), generator=gen).tolist()
            blocks.append([len(ids) + i for i in range(n)])
            ids += [token] * n
        rows.append(ids + torch.randint(3, 4096, (3,), generator=gen).tolist())
    width = max(map(len, rows))
    rows = [r + [5] * (width - len(r)) for r in rows]  # equal rows with text filler
    return torch.tensor(rows), blocks


def count_calls(*modules) -> list:
    """A list that gets one entry per forward call of any of `modules`."""
    calls = []
    for module in modules:
        module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_placeholder_count_is_the_merged_rows():
    assert [placeholder_count(g) for g in GRIDS] == ROWS
    assert placeholder_count((4, 6, 8)) == 12  # frames are mean-pooled: a clip costs one frame's rows
    model = tiny_multimodal()
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    with torch.no_grad():
        assert model.image_features(px, g).shape == (sum(ROWS), model.config.text_config.hidden_size)
    assert model.placeholder_counts(g) == ROWS
    with pytest.raises(ValueError, match=r"patch grid \(1, 3, 4\) does not tile into 2 x 2"):
        placeholder_count((1, 3, 4))


def test_image_rows_land_at_their_placeholders_in_order():
    """Two batch rows (images 0, 1 in the first, the clip in the second): each image's rows, encoded
    alone, sit exactly at its placeholder block; every other position is the token's embedding."""
    model = tiny_multimodal()
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    ids, blocks = prompt(model, [ROWS[:2], ROWS[2:]])
    with torch.no_grad():
        embeds = model.embed(ids, px, g)
        flat = embeds.flatten(0, 1)
        start = 0
        for i, (t, h, w) in enumerate(GRIDS):
            alone = model.image_features(px[start:start + t * h * w], g[i:i + 1])
            start += t * h * w
            at = torch.tensor(blocks[i]) + (0 if i < 2 else ids.shape[1])  # row-major over [B, T]
            assert_rel_close(f"image {i} rows", alone, flat[at], 1e-6)
        text = ids != model.config.media_placeholder_token_id
        assert torch.equal(embeds[text], model.language_model.model.embed_tokens(ids[text]))


def test_logits_are_the_text_model_on_the_merged_embeddings():
    model = tiny_multimodal()
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    ids, blocks = prompt(model, [ROWS])
    with torch.no_grad():
        logits = model(ids, px, g)
        assert torch.equal(logits, model.language_model(inputs_embeds=model.embed(ids, px, g)))
        other = model(ids, px.flip(0), g)  # other pixels: same text before the first image, not after
    first = blocks[0][0]
    # causal: only rounding differs before the first image (chunked KDA sums whole chunks)
    assert_rel_close("before the images", logits[:, :first], other[:, :first], 1e-5)
    assert (logits[:, first:] - other[:, first:]).abs().amax() > 1e-3


def test_placeholder_mismatch_is_a_clear_error_and_runs_no_tower():
    model = tiny_multimodal()
    calls = count_calls(model.vision_tower)
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    ids, _ = prompt(model, [ROWS])
    token = model.config.media_placeholder_token_id
    short = ids[:, ids[0] != token][:, :-1]
    short = torch.cat([short, torch.full((1, sum(ROWS) - 1), token)], dim=1)
    with pytest.raises(ValueError, match=r"^input_ids has 10 image placeholder tokens \(id 163605\), the 3 images "
                                         r"give 11 rows \(\[6, 1, 4\] per image\)"):
        model(short, px, g)
    with pytest.raises(ValueError, match=r"has 11 image placeholder tokens .* the 0 images give 0 rows"):
        model(ids)
    with pytest.raises(ValueError, match="pass pixel_values and grid_thws together"):
        model(ids, px)
    with pytest.raises(ValueError, match=r"grid_thws must be \[N, 3\]"):
        model(ids, px, g[:, :2])
    assert not calls


def test_text_only_never_runs_the_tower_and_is_the_text_model_bit_for_bit():
    model = tiny_multimodal()
    calls = count_calls(model.vision_tower, model.mm_projector)
    text = K3ForCausalLM(model.config.text_config).eval()
    text.load_state_dict(model.language_model.state_dict())
    ids = torch.randint(3, 4096, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    variants = [((ids,), {}), ((ids.view(1, -1),), {"cu_seqlens": torch.tensor([0, 7, 22])}),
                ((ids,), {"logits_to_keep": torch.tensor([10])}), ((ids,), {"attention_mask": mask})]
    with torch.no_grad():
        for args, kwargs in variants:
            assert torch.equal(model(*args, **kwargs), text(*args, **kwargs)), kwargs
    assert not calls
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    with torch.no_grad():
        model(prompt(model, [ROWS])[0], px, g)
    assert len(calls) == 2  # one tower run and one projector run for all three images


def test_inputs_embeds_seam_is_bit_exact():
    """K3ForCausalLM(inputs_embeds=embed(ids)) is K3ForCausalLM(ids): uniform, packed, padded rows,
    hidden_out; exactly one of the two inputs."""
    model = randomized(K3ForCausalLM(load_config("k3-tiny")))
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(4))
    embeds = model.model.embed_tokens(ids)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(model(inputs_embeds=embeds, **kwargs), model(ids, **kwargs)), kwargs
        cu = torch.tensor([0, 5, 18])
        got, ref = [], []
        assert torch.equal(model(inputs_embeds=embeds.view(1, 18, -1), cu_seqlens=cu, hidden_out=got),
                           model(ids.view(1, 18), cu_seqlens=cu, hidden_out=ref))
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model(ids, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        model()
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, tokens, 128\]"):
        model(inputs_embeds=embeds[..., :64])


def test_cache_continues_a_prompt_with_images():
    """Prefill with images into a cache, then one text token: the logits of the full prompt's
    last position (the cache sees image rows like any other position)."""
    model = tiny_multimodal()
    px, g = pixels(GRIDS, model.config.vision_config.patch_size)
    ids, _ = prompt(model, [ROWS])
    cache = K3Cache.empty(model.config.text_config, 1)
    with torch.no_grad():
        full = model(ids, px, g)
        model(ids[:, :-1], px, g, cache=cache)
        step = model(ids[:, -1:], cache=cache)
    assert_rel_close("next token after the images", full[:, -1], step[:, 0], 1e-5)


def test_config_round_trip_and_checks():
    published = json.loads(K3_CONFIG_JSON.read_text())
    cfg = K3MultimodalConfig.from_dict(published)
    assert cfg.to_dict() == published and list(cfg.to_dict()) == list(published)
    assert cfg.media_placeholder_token_id == 163605 and cfg.vision_config.vt_num_hidden_layers == 27
    assert K3MultimodalConfig.from_text_config(cfg.text_config).to_dict() == published
    with pytest.raises(ConfigError, match="no vision_config"):
        K3MultimodalConfig.from_dict({k: v for k, v in published.items() if k != "vision_config"})
    with pytest.raises(ConfigError, match="text_hidden_size: the projector must output the text width 7168"):
        K3MultimodalConfig(cfg.text_config, cfg.vision_config.replace(text_hidden_size=4096))


def test_published_config_builds_on_meta_and_k3_params_prints_the_vision_counts(capsys):
    cfg = K3MultimodalConfig.from_dict(json.loads(K3_CONFIG_JSON.read_text()))
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg)
    prefixes = {name.split(".")[0] for name in model.state_dict()}
    assert prefixes == {"vision_tower", "mm_projector", "language_model"}
    assert sum(p.numel() for p in model.vision_tower.parameters()) == 401_214_464
    assert sum(p.numel() for p in model.mm_projector.parameters()) == 46_144_512
    with pytest.raises(SystemExit) as exit_:
        main(["params", "--config", str(K3_CONFIG_JSON)])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "2,779,484,476,000" in printed, "the text total is unchanged"
    for n in ("401,214,464", "46,144,512", "447,358,976", "2,779,931,834,976"):
        assert n in printed, n


def test_k3_params_json_has_vision_only_with_a_vision_config(tmp_path, capsys):
    model = tiny_multimodal()
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(SystemExit):
        main(["params", "--config", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    assert out["vision"] == {"vision_tower": tower, "mm_projector": projector, "total": tower + projector}
    assert out["total"] == count_parameters(model.config.text_config)["total"]  # the text total as before
    with pytest.raises(SystemExit):
        main(["params", "--config", "k3-tiny", "--json"])
    assert "vision" not in json.loads(capsys.readouterr().out)
