"""`k3 rl`'s captured update on a GPU (k3/train/graph_step.py, DESIGN §14.5): replayed updates
compute what the same padded body run eagerly computes (fp32, within 1e-5 over 4 steps, a KL
reference and distillation included), and train as the plain eager update does."""
from __future__ import annotations

import pytest
import torch

import k3.rl.trainer as rl_trainer
from k3.rl.distill import DistillTrainer
from k3.rl.trainer import RLTrainer
from k3.train.graph_step import GraphStep
from tests.helpers.rl_update import random_trajectories, update_only_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = [(5, 7), (1, 3), (12, 4), (3, 9)]  # two rows of 40 tokens at most: one shape every step
CASES = pytest.mark.parametrize("cls, changes", [(RLTrainer, {}), (RLTrainer, {"kl_coef": 0.1}),
                                                 (DistillTrainer, {})], ids=["rl", "rl-kl", "distill"])


def _run(cls, changes, *, graphs: bool, capture: bool = True):
    trainer = update_only_trainer("cuda", graphs=graphs, cls=cls, lr=1e-3, **changes)
    if graphs and not capture:  # the reference: the same body, padding and ops, run eagerly
        trainer.graphs = GraphStep(trainer._graph_body, lambda: trainer.optimizer.zero_grad(set_to_none=True),
                                   device=trainer.world.device, pad_id=trainer.config.pad_token_id, capture=False)
    # warm-up, capture, two replays; then a step that finished no episode
    steps = [random_trajectories(n, LENGTHS, version=n) for n in range(4)] + [([], [])]
    records = []
    for n, (trajectories, advantages) in enumerate(steps):
        trainer.rollouts.policy_version = n
        records.append(trainer.optimize(trajectories, advantages))
    return trainer, records


@pytest.fixture(autouse=True)
def short_rows(monkeypatch):
    monkeypatch.setattr(rl_trainer, "TRAIN_ROW_TOKENS", 40)


@CASES
def test_captured_updates_equal_eager_updates_fp32(cls, changes):
    eager, want = _run(cls, changes, graphs=True, capture=False)
    graphed, got = _run(cls, changes, graphs=True)
    assert any(g.graph is not None for g in graphed.graphs.graphs.values()), "no step was replayed"
    for n, (a, b) in enumerate(zip(want, got)):
        assert b == pytest.approx(a, rel=1e-5, abs=2e-6), n
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


@CASES
def test_captured_updates_train_as_the_plain_eager_update(cls, changes):
    """Plain eager: varlen kernels on the real documents, logits at the trained positions only."""
    _, want = _run(cls, changes, graphs=False)
    _, got = _run(cls, changes, graphs=True)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-3, abs=1e-5)
