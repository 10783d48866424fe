"""`k3 chat` and `k3 serve` as a user meets them: a pretraining run is announced once as not
chat-tuned, the status line after a reply is plain (cache detail only with --verbose), and a
damaged weights file is one line naming it, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import json
import re

import pytest
import torch

from bench.common import random_tiny_run
from k3.checkpoint.official import save_pretrained
from k3.config import load_config
from k3.model.transformer import K3ForCausalLM
from k3.text.tokenizer import save_tokenizer, train_tokenizer
from tests.serve.fakes import one_torch_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder laid out as `k3 train` writes it (pretraining: no chat template)."""
    return random_tiny_run(tmp_path_factory.mktemp("run"))


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
    assert weights.name in refused(command, step, capsys, monkeypatch)


def refused(command: str, step, capsys, monkeypatch) -> str:
    """`k3 serve` / `k3 chat --model step` exits 2 with one error line: that line."""
    mod = importlib.import_module("k3.serve.cli" if command == "serve" else "k3.serve.chat_cli")
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    assert mod.run(p.parse_args(["--model", str(step)])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"k3 {command}: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("placeholder, message", [(None, "outside the vocabulary [0, 340) (an absent one defaults"),
                                                  (3, "is the tokenizer's special token '<|open|>'")])
@pytest.mark.parametrize("command", ["serve", "chat"])
def test_a_placeholder_id_no_request_can_use_is_refused_at_load(tmp_path, capsys, monkeypatch, command, placeholder,
                                                                 message):
    """A vision checkpoint whose image placeholder lies outside the vocabulary (absent from a small
    model's config.json: K3's 163605) or is a chat marker: one line at load, not a 400 per request."""
    from k3.checkpoint.multimodal import save_pretrained_multimodal
    from tests.model.vision.test_multimodal import tiny_multimodal
    from tests.serve.conftest import CORPUS, VOCAB

    model = tiny_multimodal(vocab_size=VOCAB)
    step = tmp_path / "vl"
    save_pretrained_multimodal(model, step)
    save_tokenizer(train_tokenizer(CORPUS, 330), step)
    config = json.loads((step / "config.json").read_text())
    config.pop("media_placeholder_token_id", None)
    if placeholder is not None:
        config["media_placeholder_token_id"] = placeholder
    (step / "config.json").write_text(json.dumps(config))
    assert message in refused(command, step, capsys, monkeypatch)


def test_bad_chat_options_are_one_line(run_dir, capsys, monkeypatch):
    for argv in (["--temperature", "5"], ["--max-tokens", "0"], ["--reasoning-effort", "extreme"]):
        code, _, err = chat(capsys, monkeypatch, ["--run", str(run_dir), *argv], [""])
        assert code == 2 and err.startswith("k3 chat: error: ") and err.count("\n") == 1, (argv, err)


def test_image_command_attaches_a_picture_to_the_next_message(tmp_path, capsys, monkeypatch):
    """`/image PATH` with a vision checkpoint: a bad path is one bracketed line and the chat goes on;
    the picture goes with the next message (its placeholders in the prompt), and the next turn
    finds it in the prefix cache. A text model says it has no vision tower."""

    from k3.checkpoint.multimodal import save_pretrained_multimodal
    from k3.media.image_processor import ImageProcessor
    from tests.media.test_video import gif_bytes
    from tests.model.vision.test_multimodal import tiny_multimodal
    from tests.serve.conftest import CORPUS, PLACEHOLDER, VOCAB
    from tests.serve.test_images import picture

    tokenizer = train_tokenizer(CORPUS, 330)
    model = tiny_multimodal(vocab_size=VOCAB)
    model.config.media_placeholder_token_id = PLACEHOLDER
    step = tmp_path / "vl"
    save_pretrained_multimodal(model, step)
    save_tokenizer(tokenizer, step)
    picture(0).save(tmp_path / "scene.png")
    (tmp_path / "notes.txt").write_text("not a picture")
    (tmp_path / "clip.gif").write_bytes(gif_bytes(10))
    lines = [f"/image {tmp_path / 'missing.png'}", f"/image {tmp_path / 'notes.txt'}", f"/image {tmp_path / 'scene.png'}",
             "What is shown in the picture?", "How many shapes are there?", f"/video {tmp_path / 'notes.txt'}",
             f"/video {tmp_path / 'clip.gif'}", "And in the video?", ""]
    code, out, _ = chat(capsys, monkeypatch, ["--model", str(step), "--max-tokens", "3", "--temperature", "0",
                                              "--verbose"], lines)
    assert code == 0 and "/image PATH or /video PATH attaches one" in out
    assert f"[{tmp_path / 'missing.png'}: No such file or directory]" in out
    assert f"[{tmp_path / 'notes.txt'}: not an image file; PNG and JPEG are accepted]" in out
    assert f"[attached {tmp_path / 'scene.png'}: it goes with your next message]" in out
    status = [line for line in out.splitlines() if line.startswith("[stopped:")]
    assert len(status) == 3, out
    assert f"[{tmp_path / 'notes.txt'}: not a video file name; accepted: .mp4" in out
    placeholders = ImageProcessor.from_vision_config(model.config.vision_config)([picture(0)]).num_placeholders[0]
    first, second, third = (tuple(map(int, re.search(r"(\d+) prompt tokens, (\d+) from the prefix cache", s).groups()))
                            for s in status)
    assert first[0] > placeholders  # prompt tokens: the image's placeholders and the text
    assert second[1] >= first[0] - 8  # the next turn reads the first (image included) from the prefix cache
    assert third[0] > second[0] + 2 * placeholders  # two clips of the video (each at least an image's size here)
    assert third[1] >= second[0] - 8

    # a picture too big for the model's length: that message is not sent, the conversation goes on
    picture(1, size=(1400, 1400)).save(tmp_path / "big.png")
    code, out, _ = chat(capsys, monkeypatch, ["--model", str(step), "--max-tokens", "3", "--temperature", "0"],
                        [f"/image {tmp_path / 'big.png'}", "What is this?", "Hello?", ""])
    assert code == 0 and "[not sent: with this message the conversation is " in out, out
    assert sum(line.startswith("[stopped:") for line in out.splitlines()) == 1  # "Hello?" was answered

    text_step = tmp_path / "text"
    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(load_config("k3-tiny").replace(vocab_size=tokenizer.get_vocab_size())), text_step)
    save_tokenizer(tokenizer, text_step)
    code, out, _ = chat(capsys, monkeypatch, ["--model", str(text_step), "--max-tokens", "2"],
                        [f"/image {tmp_path / 'scene.png'}", ""])
    assert code == 0 and "has no vision tower: /image needs a multimodal checkpoint" in out
    assert "attaches one" not in out


@pytest.mark.parametrize("styled", [True, False])
def test_reasoning_is_dimmed_on_a_terminal_and_labelled_when_piped(styled, capsys):
    from k3.serve.chat_cli import ReplyPrinter

    show = ReplyPrinter(styled)
    show([("reasoning", "add "), ("reasoning", "them"), ("call", "x")])
    show([("content", "It is "), ("content", "4.")])
    out = capsys.readouterr().out
    if styled:
        assert out == "\033[2madd \033[0m\033[2mthem\033[0mIt is 4."
    else:
        assert out == "thinking: add them\nIt is 4." and "\033" not in out
