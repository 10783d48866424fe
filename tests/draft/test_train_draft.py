"""`k3 train-draft` end to end on a very small run: the draft trains on the target's outputs
(its LK loss falls), is saved as safetensors beside the run and serves through the engine with
the same greedy outputs; a draft is refused, in one line, for another run, another vocabulary
or a folder that is not a draft, and bad speculation settings are refused before loading."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from k3.checkpoint.draft_folder import DraftError, load_draft, save_draft
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.draft import cli as draft_cli
from k3.draft.trainer import DraftSettings, DraftTrainer
from k3.generation.generate import generate
from k3.model.draft import EagleDraft
from k3.serve import cli as serve_cli
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from tests.helpers.train import trained_tiny_run
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return trained_tiny_run(tmp_path_factory.mktemp("pre"))


def _args(run_dir: Path, **changes) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    draft_cli.add_arguments(p)
    argv = ["--run", str(run_dir), "--steps", "6", "--num-sequences", "8", "--seq-len", "40", "--prompt-len", "8",
            "--batch-size", "4", "--no-progress", "--cache-dir", str(run_dir.parent / "cache")]
    for k, v in changes.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_train_draft_saves_a_draft_that_serves_exactly(run_dir, capsys):
    assert draft_cli.run(_args(run_dir)) == 0
    folder = run_dir / "draft"
    meta = json.loads((folder / "draft.json").read_text())
    assert (folder / "model.safetensors").is_file() and meta["training"]["settings"]["unroll"] == 7
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6 and len(records[0]["per_step"]) == 7
    model = load_pretrained(resolve_checkpoint(run_dir)).eval()
    draft = load_draft(folder, model)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    engine = LLMEngine(model, EngineConfig(num_speculative_tokens=3), draft=draft)
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert got == generate(model, prompts, 8)
    assert "draft saved to" in capsys.readouterr().out


def test_unrolled_training_lowers_the_lk_loss(run_dir):
    torch.manual_seed(0)
    model = load_pretrained(resolve_checkpoint(run_dir)).eval()
    data = torch.randint(3, model.config.vocab_size, (16, 40))
    data[:, 20:] = data[:, :20]  # a copy the draft can learn to predict
    draft = EagleDraft(model.config.replace(kda_chunk_size=16))
    records = DraftTrainer(model, draft, DraftSettings(steps=20, batch_size=4, anchor_every=8, lr=1e-2)).train(data)
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]


def test_a_draft_for_another_model_is_refused(run_dir, tmp_path):
    model = load_pretrained(resolve_checkpoint(run_dir)).eval()
    other = load_pretrained(resolve_checkpoint(run_dir)).eval()
    with torch.no_grad():
        other.lm_head.weight.add_(0.1)
    save_draft(EagleDraft(other.config), other, tmp_path / "other")
    with pytest.raises(DraftError, match="trained on another model"):
        load_draft(tmp_path / "other", model)
    wider = model.config.replace(vocab_size=model.config.vocab_size + 64)
    from k3.model.transformer import K3ForCausalLM
    big = K3ForCausalLM(wider)
    save_draft(EagleDraft(wider), big, tmp_path / "vocab")
    with pytest.raises(DraftError, match="vocabulary"):
        load_draft(tmp_path / "vocab", model)
    with pytest.raises(DraftError, match="not a draft folder"):
        load_draft(tmp_path, model)


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "3"], "needs --draft"),
    (["--draft", "X", "--num-speculative-tokens", "0"], "must be in [1, 16]"),
    (["--draft", "X", "--num-speculative-tokens", "17"], "must be in [1, 16]"),
    (["--batch-invariant", "--device", "cuda"], "CPU-only"),
    (["--batch-invariant", "--compile"], "exclude each other"),
])
def test_serve_refuses_bad_speculation_settings_in_one_line(run_dir, argv, message, capsys):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.run(p.parse_args(["--run", str(run_dir)] + argv)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_serve_refuses_a_draft_of_another_run_in_one_line(run_dir, tmp_path, capsys):
    model = load_pretrained(resolve_checkpoint(run_dir)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)
    save_draft(EagleDraft(model.config), model, tmp_path / "d")
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.run(p.parse_args(["--run", str(run_dir), "--draft", str(tmp_path / "d")])) == 2
    err = capsys.readouterr().err.strip()
    assert "trained on another model" in err and len(err.splitlines()) == 1
