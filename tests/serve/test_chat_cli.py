"""`k3 chat` and `k3 serve` as a user meets them: a pretraining run is announced once as not
chat-tuned, the status line after a reply is plain (cache detail only with --verbose), and a
damaged weights file is one line naming it, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch

from k3.checkpoint.official import save_pretrained
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.text.tokenizer import save_tokenizer, train_tokenizer
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder laid out as `k3 train` writes it (pretraining: no chat template)."""
    tokenizer = train_tokenizer(["The quick brown fox jumps over the lazy dog."] * 4, 300)
    torch.manual_seed(0)
    model = K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size()))
    step = tmp_path_factory.mktemp("run") / "checkpoints" / "step_0000001"
    save_pretrained(model, step)
    save_tokenizer(tokenizer, step)
    return step.parent.parent


def chat(capsys, monkeypatch, argv: list[str], lines: list[str]) -> tuple[int, str, str]:
    mod = importlib.import_module("k3.serve.chat_cli")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    answers = iter(lines)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    code = mod.run(p.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pretraining_run_is_announced_and_the_status_line_is_plain(run_dir, capsys, monkeypatch):
    code, out, _ = chat(capsys, monkeypatch, ["--run", str(run_dir), "--max-tokens", "5", "--temperature", "0"],
                        ["hello", "again", ""])
    assert code == 0
    assert out.count("has not been chat-tuned") == 1 and "supervised fine-tuning" in out and "k3 sft" in out
    status = [line for line in out.splitlines() if line.startswith("[stopped:")]
    assert len(status) == 2 and all(s in ("[stopped: length limit (5 tokens)]", "[stopped: end of reply]")
                                    for s in status), status
    assert "prefix cache" not in out


def test_verbose_shows_the_cache_detail(run_dir, capsys, monkeypatch):
    _, out, _ = chat(capsys, monkeypatch, ["--run", str(run_dir), "--max-tokens", "3", "--temperature", "0",
                                           "--verbose"], ["hello", "again", ""])
    status = [line for line in out.splitlines() if line.startswith("[stopped:")]
    assert len(status) == 2 and all("from the prefix cache" in s for s in status), status


def test_a_chat_tuned_checkpoint_is_not_announced(run_dir, tmp_path, capsys, monkeypatch):
    import shutil

    step = tmp_path / "tuned"
    shutil.copytree(run_dir / "checkpoints" / "step_0000001", step)
    config = json.loads((step / "tokenizer_config.json").read_text())
    (step / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "k3"}))
    code, out, _ = chat(capsys, monkeypatch, ["--model", str(step), "--max-tokens", "2"], [""])
    assert code == 0 and "chat-tuned" not in out


@pytest.mark.parametrize("damage", ["truncated", "header"])
@pytest.mark.parametrize("command", ["serve", "chat"])
def test_damaged_weights_are_one_line_naming_the_file(run_dir, tmp_path, capsys, monkeypatch, command, damage):
    import shutil

    step = tmp_path / "damaged"
    shutil.copytree(run_dir / "checkpoints" / "step_0000001", step)
    weights = min(step.glob("*.safetensors"))
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[:len(data) // 2])
    else:  # flip the header-length bytes
        weights.write_bytes(bytes(b ^ 0xFF for b in data[:8]) + data[8:])
    mod = importlib.import_module("k3.serve.cli" if command == "serve" else "k3.serve.chat_cli")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    assert mod.run(p.parse_args(["--model", str(step)])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"k3 {command}: error: ") and "\n" not in err and weights.name in err, err


def test_bad_chat_options_are_one_line(run_dir, capsys, monkeypatch):
    for argv in (["--temperature", "5"], ["--max-tokens", "0"], ["--reasoning-effort", "extreme"]):
        code, _, err = chat(capsys, monkeypatch, ["--run", str(run_dir), *argv], [""])
        assert code == 2 and err.startswith("k3 chat: error: ") and err.count("\n") == 1, (argv, err)
