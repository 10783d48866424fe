"""Damaged checkpoints (truncated or flipped safetensors, broken JSON, a missing shard) are one
CheckpointError naming the file, and the verbs that load them print one line, no traceback."""
from __future__ import annotations

import json

import pytest

from k3.checkpoint.files import INDEX_NAME, CheckpointError
from k3.checkpoint.official import save_pretrained
from k3.checkpoint.pretrained import load_pretrained
from k3.cli import main
from k3.model.transformer import K3ForCausalLM
from k3.text.tokenizer import save_tokenizer, train_tokenizer
from tests.helpers.models import small_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_pretrained(K3ForCausalLM(small_config(vocab_size=320)), root / "good", max_shard_bytes=200_000)
    return root / "good"


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shard(folder):
    return sorted(folder.glob("model-*.safetensors"))[1]


def _truncate(folder):
    shard = _shard(folder)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def _flip_header(folder):
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    for i in range(8, 40):  # inside the JSON header after its 8-byte length
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def _flip_length(folder):
    shard = _shard(folder)
    data = bytearray(shard.read_bytes())
    data[7] ^= 0xFF  # the header length: now far past the end of the file
    shard.write_bytes(bytes(data))
    return shard


def _drop_shard(folder):
    shard = _shard(folder)
    shard.unlink()
    return shard


def _bad_index(folder):
    (folder / INDEX_NAME).write_text('{"weight_map": ')
    return folder / INDEX_NAME


def _bad_config(folder):
    (folder / "config.json").write_bytes(b"\xff\xfe not json")
    return folder / "config.json"


DAMAGE = {"truncated": _truncate, "header-flipped": _flip_header, "length-flipped": _flip_length,
          "missing-shard": _drop_shard, "bad-index": _bad_index, "bad-config": _bad_config}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_is_one_error_naming_the_file(saved, tmp_path, damage):
    folder = _copy(saved, tmp_path / damage)
    bad_file = DAMAGE[damage](folder)
    with pytest.raises(CheckpointError) as err:
        load_pretrained(folder)
    assert str(bad_file) in str(err.value)
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


@pytest.mark.parametrize("verb", ["generate", "quantize"])
def test_verbs_print_one_line_for_a_damaged_checkpoint(saved, tmp_path, capsys, verb):
    folder = _copy(saved, tmp_path / "ckpt")
    save_tokenizer(train_tokenizer(["to be or not to be"] * 4, 320), folder)
    shard = _truncate(folder)
    argv = {"generate": ["generate", "--run", str(folder), "--prompt", "hi"],
            "quantize": ["quantize", "--model", str(folder), "--out", str(tmp_path / "out")]}[verb]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("k3: ")]
    assert len(err) == 1 and err[0].startswith(f"k3 {verb}: error: {shard}"), err


def test_quantize_accepts_a_run_folder(saved, tmp_path, capsys):
    run = tmp_path / "run"
    _copy(saved, (run / "checkpoints").mkdir(parents=True) or run / "checkpoints" / "step_0000007")
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--model", str(run), "--out", str(tmp_path / "mx")])
    assert exit_.value.code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "mx" / "config.json").read_text())  # written
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "mx2")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("k3 quantize: error: ")
