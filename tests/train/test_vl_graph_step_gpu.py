"""The VL trainer's captured step on a GPU (DESIGN §14.5): replayed steps compute what the same
padded body run eagerly computes (fp32, within 1e-5: warm-up, capture and two replays, the vision
tower's weights included), and in bf16 (the tower's varlen flash attention captured) they train as
the plain eager VL step does (within bf16 rounding)."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from k3.train import vl_trainer
from k3.train.graph_step import GraphStep
from k3.train.trainer import Trainer
from k3.train.vl_trainer import VLTrainer
from tests.helpers.gpu import side_stream  # noqa: F401 (a fixture)
from tests.helpers.train import quiet
from tests.train.test_vl_trainer import micro_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("side_stream")]

STEPS = 4  # warm-up, capture, two replays


@pytest.fixture(autouse=True)
def one_bucket(monkeypatch):
    """Every step's rows padded to 512 tokens: one graph, so the steps after the capture replay it."""
    monkeypatch.setattr(vl_trainer, "token_bucket", lambda tokens: 512)


def _steps(root, name: str, *, graphs: bool, capture: bool = True) -> tuple[VLTrainer, list[dict]]:
    trainer = VLTrainer(micro_settings(root, name, device="cuda", steps=STEPS, vl_scenes=2, grad_accum=2,
                                       batch_size=2, cuda_graphs=graphs), progress=False, log=quiet)
    assert (trainer.graphs is not None) == graphs
    if graphs and not capture:  # the reference: the same body, padding and ops, run eagerly
        trainer.graphs = GraphStep(trainer._graph_body, lambda: trainer.optimizer.zero_grad(set_to_none=True),
                                   device=trainer.world.device, pad_id=trainer.config.pad_token_id, capture=False)
    records = [trainer.train_step() for _ in range(STEPS)]
    trainer._flush_steps(records, time.perf_counter(), None)
    return trainer, records


def _close(got: list[dict], want: list[dict], rel: float, abs_: float) -> None:
    for n, (a, b) in enumerate(zip(want, got)):
        for k in ("loss", "text_loss", "image_loss", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=rel, abs=abs_), (n, k)


def test_captured_vl_steps_equal_eager_vl_steps_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "_autocast", lambda self: contextlib.nullcontext())
    eager, want = _steps(tmp_path, "eager", graphs=True, capture=False)
    graphed, got = _steps(tmp_path, "graphed", graphs=True)
    assert any(g.graph is not None for g in graphed.graphs.graphs.values()), "no step was replayed"
    assert graphed.graphs.capture_error is None
    _close(got, want, 1e-5, 2e-6)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_captured_vl_steps_train_as_the_plain_eager_step_bf16(tmp_path):
    _, want = _steps(tmp_path, "plain", graphs=False)
    graphed, got = _steps(tmp_path, "graphed", graphs=True)
    assert any(g.graph is not None for g in graphed.graphs.graphs.values()), "no step was replayed"
    _close(got, want, 2e-2, 1e-3)
