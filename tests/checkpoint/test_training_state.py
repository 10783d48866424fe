"""Training checkpoints: a failed save (full disk) leaves no temp folder and one clear error; only
the latest kept checkpoint carries the resume state unless asked to keep it everywhere."""
from __future__ import annotations

import errno

import pytest
import torch
from safetensors import SafetensorError

from k3.checkpoint import training_state as ckpt
from k3.checkpoint.run_folder import list_checkpoints
from k3.model.transformer import K3ForCausalLM
from tests.helpers.models import small_config


def _parts():
    model = K3ForCausalLM(small_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # so every parameter has optimizer state to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _save(root, step, parts, **kwargs):
    return ckpt.save_checkpoint(root, step, *parts, {"elapsed": 0.0}, lambda d: None, **kwargs)


def test_full_disk_removes_the_temp_folder_and_names_the_cause(tmp_path, monkeypatch):
    parts = _parts()
    root = tmp_path / "checkpoints"
    _save(root, 1, parts, keep=3)

    def no_space(tensors, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(ckpt, "save_file", no_space)
    with pytest.raises(ckpt.CheckpointSaveError) as err:
        _save(root, 2, parts, keep=3)
    assert str(err.value) == f"cannot save checkpoint {root / 'step_0000002'}: No space left on device"
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001"]  # no temp folder left behind
    assert ckpt.has_resume_state(root / "step_0000001")


def test_a_safetensors_write_error_is_a_save_error_too(tmp_path, monkeypatch):
    """safetensors reports I/O failures (a full disk) as SafetensorError, not OSError."""
    parts = _parts()
    root = tmp_path / "checkpoints"

    def failing(tensors, path, *a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", failing)
    with pytest.raises(ckpt.CheckpointSaveError, match="No space left on device"):
        _save(root, 1, parts, keep=3)
    assert list(root.iterdir()) == []  # no temp folder left behind


@pytest.mark.parametrize("keep_all_state", [False, True], ids=["latest-only", "keep-all"])
def test_resume_state_only_in_the_latest_checkpoint(tmp_path, keep_all_state):
    parts = _parts()
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _save(root, step, parts, keep=3, keep_all_state=keep_all_state)
    kept = list_checkpoints(root)
    assert [p.name for p in kept] == ["step_0000002", "step_0000003", "step_0000004"]
    assert ckpt.has_resume_state(kept[-1])
    for older in kept[:-1]:
        assert (older / "config.json").is_file() and (older / "model.safetensors.index.json").is_file()
        assert ckpt.has_resume_state(older) == keep_all_state
    if not keep_all_state:
        with pytest.raises(ckpt.ResumeStateError, match="optimizer.safetensors"):
            ckpt.load_checkpoint(kept[0], *parts)
    state = ckpt.load_checkpoint(kept[-1], *parts)
    assert state["step"] == 4


def _truncate(path, n=1000):
    path.write_bytes(path.read_bytes()[:n])


@pytest.mark.parametrize("damage", [
    lambda d: _truncate(next(d.glob("model*.safetensors"))),
    lambda d: _truncate(d / ckpt.OPTIMIZER_FILE),
    lambda d: (d / ckpt.RNG_FILE).write_bytes(b""),
    lambda d: (d / ckpt.TRAINER_STATE).write_text("{"),
    lambda d: (d / ckpt.TRAINER_STATE).write_text("{}"),
], ids=["model", "optimizer", "rng", "state-not-json", "state-empty"])
def test_a_damaged_checkpoint_is_one_resume_error(tmp_path, damage):
    """A truncated or emptied file is a one-line ResumeStateError naming the folder, not a traceback."""
    parts = _parts()
    folder = _save(tmp_path / "checkpoints", 1, parts, keep=1)
    damage(folder)
    with pytest.raises(ckpt.ResumeStateError) as err:
        ckpt.load_checkpoint(folder, *parts)
    assert str(err.value).startswith(f"cannot resume from {folder}: ") and "\n" not in str(err.value)


def test_weights_of_another_shape_are_one_resume_error(tmp_path):
    """An edited run.json (another width) builds a model the checkpoint does not fit."""
    folder = _save(tmp_path / "checkpoints", 1, _parts(), keep=1)
    other = K3ForCausalLM(small_config().replace(hidden_size=small_config().hidden_size * 2))
    optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(ckpt.ResumeStateError, match="cannot resume from"):
        ckpt.load_checkpoint(folder, other, optimizer, scheduler)
