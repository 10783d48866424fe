"""The captured training step on a GPU (k3/train/graph_step.py): replayed steps compute what the
same step run eagerly computes (fp32, within 1e-5 over 6 steps), and in bf16 they train as the
plain eager step does (within bf16 rounding)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from k3.train.graph_step import GraphStep
from k3.train.trainer import Trainer
from tests.helpers.train import losses, quiet, tiny_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _train(root, name, *, graphs: bool, capture: bool = True):
    trainer = Trainer(tiny_settings(root, name, device="cuda", steps=6, eval_every=6, ckpt_every=6,
                                    cuda_graphs=graphs), progress=False, log=quiet)
    if graphs and not capture:  # the reference: the same body, padding and ops, run eagerly
        trainer.graphs = GraphStep(trainer._graph_body, lambda: trainer.optimizer.zero_grad(set_to_none=True),
                                   device=trainer.world.device, pad_id=trainer.config.pad_token_id, capture=False)
    trainer.train()
    return trainer


@pytest.fixture
def fp32(monkeypatch):
    monkeypatch.setattr(Trainer, "_autocast", lambda self: contextlib.nullcontext())


def test_captured_steps_equal_eager_steps_fp32(tmp_path, fp32):
    eager = _train(tmp_path, "eager", graphs=True, capture=False)
    graphed = _train(tmp_path, "graphed", graphs=True)
    assert any(g.graph is not None for g in graphed.graphs.graphs.values()), "no step was replayed"
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_captured_steps_train_as_the_plain_eager_step_bf16(tmp_path):
    _train(tmp_path, "plain", graphs=False)
    _train(tmp_path, "graphed", graphs=True)
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "plain"), rel=2e-2)
