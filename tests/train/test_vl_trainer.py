"""Joint VL training (`k3 train --config k3-tiny-vl`, DESIGN §7) on a micro config: a run writes a
multimodal checkpoint, metrics with text and image losses, the held-out accuracy and both
baselines; packing keeps documents apart (text or image) with one placeholder per merged image row;
the tower's weights get Per-Head Muon / AdamW groups; resume after a kill replays the run bit for bit."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3.checkpoint.multimodal import load_pretrained_multimodal
from k3.data import shapes_corpus as corpus
from k3.model.multimodal import K3ForConditionalGeneration
from k3.train import cli as train_cli
from k3.train.metrics import MetricsLog
from k3.train.packing import IGNORE_INDEX
from k3.train.vl_config import VL_PRESETS, load_vl_config
from k3.train.vl_data import describe, pack_vl, scene_questions
from k3.train.vl_trainer import VLSettings, VLTrainer, vl_param_groups
from tests.helpers.train import REPO, quiet, small_corpus

# k3-tiny-vl cut down: 2 text layers (KDA + MLA) at d=64, a 1-block tower of width 32 (2 heads of 16)
MICRO = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96, "num_experts": 4,
         "kda_chunk_size": 16, "vision_config.vt_hidden_size": 32, "vision_config.vt_num_hidden_layers": 1,
         "vision_config.vt_num_attention_heads": 2, "vision_config.qkv_hidden_size": 32,
         "vision_config.vt_intermediate_size": 64}


def micro_settings(root: Path, name: str, **changes) -> VLSettings:
    base = VLSettings(overrides=dict(MICRO), data=small_corpus(root), out=str(root / name), steps=4, batch_size=2,
                      seq_len=32, vl_scenes=4, vl_questions=2, image_size=56, lr=3e-3, eval_every=2, eval_windows=2,
                      ckpt_every=2, keep=2, sample_tokens=4, val_fraction=0.1, vqa_eval=6, baseline_examples=20,
                      max_answer_tokens=3, cache_dir=str(root / "cache"))
    return dataclasses.replace(base, **changes)


def train_records(run: str | Path) -> list[tuple[float, float, float]]:
    return [(r["loss"], r["text_loss"], r["image_loss"]) for r in MetricsLog(Path(run)).read() if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    settings = micro_settings(root, "ref")
    trainer = VLTrainer(settings, progress=False, log=quiet)
    result = trainer.train()
    return root, settings, trainer, result


def test_run_writes_checkpoint_metrics_and_vqa_figures(reference_run):
    _, settings, trainer, result = reference_run
    run = Path(settings.out)
    from k3.serve.loading import is_chat_tuned

    assert is_chat_tuned(run / "tokenizer.json")  # conversations were learned: `k3 chat` takes it as a chat model
    for name in ("run.json", "tokenizer.json", "metrics.jsonl", "loss.png", "report.md"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    model = load_pretrained_multimodal(run / "checkpoints" / "step_0000004")  # the published multimodal layout
    assert isinstance(model, K3ForConditionalGeneration)
    assert model.config.media_placeholder_token_id == trainer.tokenizer.token_to_id(corpus.IMAGE_PLACEHOLDER) == 319
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    records = MetricsLog(run).read()
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["text_loss"] > 0 and r["image_loss"] > 0 and r["images"] == 4 for r in train)
    assert all(r["loss"] == pytest.approx(r["text_loss"] + r["image_loss"]) for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0 <= r["vqa_accuracy"] <= 1 and r["val_image_loss"] > 0 and r["vqa_questions"] == 6 for r in evals)
    line = trainer.eval_line(evals[-1])  # what the progress bar prints at each eval
    assert "val loss" in line and f"held-out questions {100 * evals[-1]['vqa_accuracy']:.1f}%" in line
    (vqa,) = [r for r in records if r["kind"] == "vqa"]
    assert vqa["accuracy"] == result["vqa_accuracy"] and 0 <= vqa["blank_image_accuracy"] <= 1
    # the corpus's own majority baseline, recomputed
    majority = corpus.TextOnlyBaseline(corpus.examples("train", 20, 0, size=56))
    assert vqa["majority_accuracy"] == majority.accuracy(corpus.examples("heldout", 6, 0, size=56))
    report = (run / "report.md").read_text()
    assert "Held-out visual questions" in report and "blank images" in report and "majority answer" in report


def test_packing_keeps_documents_apart_with_one_placeholder_per_merged_row(reference_run):
    _, settings, trainer, _ = reference_run
    docs = [trainer.encoder.document(scene.image, qas) for scene, qas in (scene_questions(0, i, 2, 56) for i in range(3))]
    scene, qas = scene_questions(0, 0, 1, 112)
    big = trainer.encoder.document(scene.image, qas, describe(scene))  # 8 x 8 patches: 16 merged rows
    batch = pack_vl(trainer.train_data, [0, 5], settings.seq_len, docs + [big])
    placeholder = trainer.mm_config.media_placeholder_token_id
    end_of_msg = trainer.tokenizer.token_to_id("<|end_of_msg|>")
    ids, cu = batch.input_ids[0], batch.cu_seqlens.tolist()
    assert batch.grid_thws.tolist() == [[1, 4, 4]] * 3 + [[1, 8, 8]]
    assert batch.pixel_values.shape == (3 * 16 + 64, 3, 14, 14)
    # the text windows first (their own segments), then one segment per VL document
    assert cu[-5:] == [2 * settings.seq_len + sum(len(d.ids) - 1 for d in docs[:i]) for i in range(4)] + [len(ids)]
    assert not batch.is_vl[0, :2 * settings.seq_len].any() and batch.is_vl[0, 2 * settings.seq_len:].all()
    for (s, e), d, rows in zip(zip(cu[-5:], cu[-4:]), docs + [big], [4, 4, 4, 16]):
        seg = ids[s:e]
        assert int((seg == placeholder).sum()) == rows  # (h / 2) * (w / 2) placeholders, one contiguous run
        first = int((seg == placeholder).nonzero()[0])
        assert (seg[first:first + rows] == placeholder).all()
        assert seg[0] == trainer.encoder.chat.open  # a chat conversation: no bos, as the server renders it
        labels = batch.labels[0, s:e]
        learned = labels[labels != IGNORE_INDEX]
        assert int((learned == end_of_msg).sum()) == d.answers == 2  # 2 answers, or 1 + the scene
        assert torch.equal(learned, torch.from_numpy(d.ids[1:][d.mask[1:]]))
    described = trainer.tokenizer.decode(big.ids[big.mask].tolist())
    assert describe(scene_questions(0, 0, 1, 112)[0]) in described and qas[0].answer in described
    # documents never see each other: another image or question in document 1 leaves the rest unchanged
    model = trainer.model.eval()
    scene, qas = scene_questions(0, 99, 2, 56)
    other = trainer.encoder.document(scene.image, qas)
    swapped = pack_vl(trainer.train_data, [0, 5], settings.seq_len, [docs[0], other, docs[2], big])
    with torch.no_grad():
        a = model(batch.input_ids, batch.pixel_values, batch.grid_thws, cu_seqlens=batch.cu_seqlens)[0]
        b = model(swapped.input_ids, swapped.pixel_values, swapped.grid_thws, cu_seqlens=swapped.cu_seqlens)[0]
    s1, e1 = cu[-4], cu[-3]
    n_other = len(other.ids) - 1
    torch.testing.assert_close(a[:s1], b[:s1], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[e1:], b[s1 + n_other:], rtol=0, atol=1e-5)
    assert not torch.allclose(a[s1:e1][-1], b[s1:s1 + n_other][-1])
    model.train()


def test_vision_weights_get_per_head_muon_and_adamw_groups(reference_run):
    _, _, trainer, _ = reference_run
    model = trainer.model
    groups = vl_param_groups(model, weight_decay=0.1)
    where = {n: g["name"] for g in groups for n in g["param_names"]}
    assert sorted(where) == sorted(n for n, _ in model.named_parameters())  # each exactly once
    head = model.config.vision_config.head_dim
    assert where["vision_tower.encoder.blocks.0.wqkv.weight"] == f"vision_muon_rows{head}"
    assert where["vision_tower.encoder.blocks.0.wo.weight"] == f"vision_muon_cols{head}"
    assert where["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == "vision_muon_whole"
    assert where["mm_projector.proj.0.weight"] == where["mm_projector.proj.2.weight"] == "vision_muon_whole"
    assert (where["vision_tower.patch_embed.proj.weight"] == where["vision_tower.patch_embed.pos_emb.weight"]
            == "vision_adamw_decay")
    assert (where["vision_tower.encoder.blocks.0.norm0.weight"] == where["mm_projector.post_norm.weight"]
            == "vision_adamw_no_decay")
    assert where["language_model.lm_head.weight"] == where["language_model.model.embed_tokens.weight"] == "adamw_decay"
    assert where["language_model.model.layers.0.self_attn.q_proj.weight"].startswith("muon_rows")
    names = {g["name"] for g in vl_param_groups(model, weight_decay=0.1, optimizer="adamw")}
    assert names == {"adamw_decay", "adamw_no_decay", "vision_adamw_decay", "vision_adamw_no_decay"}
    scaled = vl_param_groups(model, weight_decay=0.1, vision_optimizer="adamw", vision_lr=1e-4)
    assert {g["name"]: g.get("lr") for g in scaled if g["name"].startswith("vision_")} == {
        "vision_adamw_decay": 1e-4, "vision_adamw_no_decay": 1e-4}
    assert all("lr" not in g for g in scaled if not g["name"].startswith("vision_"))


KILL_AFTER_STEP_3 = """
import json, os, signal, sys
from k3.train.vl_trainer import VLSettings, VLTrainer
real = VLTrainer.train_step
def dying_step(self):
    record = real(self)
    if record["step"] == 3:
        self.metrics.write({**record, "step_tokens": None})  # the record lands, then a real kill
        os.kill(os.getpid(), signal.SIGKILL)
    return record
VLTrainer.train_step = dying_step
settings = json.loads(sys.argv[1])
settings["sample_prompts"] = tuple(settings["sample_prompts"])
VLTrainer(VLSettings(**settings), progress=False).train()
"""


def test_resume_after_kill_is_bit_exact(reference_run):
    root, settings, _, _ = reference_run
    killed = micro_settings(root, "killed")
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_STEP_3, json.dumps(dataclasses.asdict(killed))],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(train_records(killed.out)) == 3 and (Path(killed.out) / "checkpoints" / "step_0000002").is_dir()
    trainer = VLTrainer.from_run(killed.out, progress=False, log=quiet)
    assert trainer.step == 2
    trainer.train()
    assert train_records(killed.out) == train_records(settings.out)  # bit for bit, both losses
    ref = [r for r in MetricsLog(Path(settings.out)).read() if r["kind"] == "vqa"]
    again = [r for r in MetricsLog(Path(killed.out)).read() if r["kind"] == "vqa"]
    drop = ("elapsed",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in again] == [
        {k: v for k, v in r.items() if k not in drop} for r in ref]


def test_cli_routes_vl_configs_and_rejects_unknown_vision_fields(reference_run, tmp_path, capsys):
    assert "k3-tiny-vl" in VL_PRESETS
    cfg = load_vl_config("k3-tiny-vl")
    assert cfg.vision_config.text_hidden_size == cfg.text_config.hidden_size == 128
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    args = parser.parse_args(["--config", "k3-tiny-vl", "--set", "vision_config.nope=1", "--out", str(tmp_path / "r"),
                              "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    assert train_cli._is_vl_run(args)
    assert train_cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 train: error:") and "vision_config.nope" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()
    assert not train_cli._is_vl_run(parser.parse_args([]))
    # VL flags name the settings VLSettings has, and a text run refuses them in one line
    vl = parser.parse_args(["--config", "k3-tiny-vl", "--vl-scenes", "6", "--vl-questions", "3", "--image-size", "56",
                            "--vl-thinking"])
    s = train_cli._settings(vl, VLSettings())
    assert (s.vl_scenes, s.vl_questions, s.image_size, s.vl_thinking) == (6, 3, 56, True)
    assert train_cli.run(parser.parse_args(["--vl-scenes", "4", "--out", str(tmp_path / "t")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3 train: error: --vl-scenes applies to vision-language configs") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()
    assert train_cli._is_vl_run(parser.parse_args(["--resume", reference_run[1].out]))  # a VL run resumes as one


def test_scene_stream_is_a_pure_function_of_seed_and_index():
    a, a_qas = scene_questions(3, 17, 3, 56)
    b, b_qas = scene_questions(3, 17, 3, 56)
    assert a_qas == b_qas and np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert len({q.qtype for q in a_qas}) == 3  # distinct question types per scene
    c, c_qas = scene_questions(4, 17, 3, 56)
    assert c_qas != a_qas or not np.array_equal(np.asarray(c.image), np.asarray(a.image))
    # the description names every item in its grid cell (raster order), "-" for empty cells
    items = describe(a).removeprefix("Scene: ").split(", ")
    assert len(items) == 9 and sum(i != "-" for i in items) == len(a.shapes) + (a.digit is not None)
    assert sorted(i for i in items if " " in i) == sorted(f"{s.colour} {s.kind}" for s in a.shapes)
