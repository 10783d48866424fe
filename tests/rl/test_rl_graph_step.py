"""`k3 rl`'s update through the captured-step machinery on CPU (k3/train/graph_step.py, DESIGN
§14.5): trajectory rows padded to one shape change no log-prob, loss or metric; the padded body
(log-probs, objective, metrics) reads nothing on the host; and `optimize()` through GraphStep
(its body run eagerly in host-free mode) trains as the eager update does, with a KL reference and
for distillation too. No balance rule in the comparison: pad tokens enter the router statistics,
as in `k3 sft`'s."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import k3.rl.trainer as rl_trainer
from k3.ops.host_free import host_free
from k3.rl.distill import DistillTrainer
from k3.rl.objective import pack_trajectories, pad_rl_batch, policy_terms, token_logprobs
from k3.rl.trainer import RLTrainer
from k3.train.graph_step import GraphStep
from k3.train.parallel import World
from tests.helpers.host_reads import no_host_reads
from tests.helpers.rl_update import VOCAB, random_trajectories, update_only_trainer
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)

STEPS = [[(5, 7), (1, 3), (12, 4), (3, 9)], [(4, 6), (2, 10), (6, 5)], [(30, 20), (2, 3)]]


def test_padded_rows_change_no_logprob_loss_or_metric():
    trainer = update_only_trainer(graphs=False)
    trajectories, advantages = random_trajectories(0, STEPS[0], version=2)
    batch = pack_trajectories(trajectories, advantages)
    padded = pad_rl_batch(batch, tokens=48, docs=8, pad_id=2)
    n = batch.targets.numel()
    assert padded.cu_seqlens.tolist() == batch.cu_seqlens.tolist() + [48] * 4
    assert padded.input_ids[0, n:].eq(2).all() and padded.targets[n:].eq(2).all() and not padded.mask[n:].any()
    assert padded.versions[n:].eq(-1).all() and padded.seq_ids[n:].eq(-1).all() and padded.advantages[n:].eq(0).all()
    with pytest.raises(ValueError, match="does not fit"):
        pad_rl_batch(batch, tokens=n - 1, docs=8, pad_id=2)
    model = trainer.model.eval()
    with torch.no_grad():
        want, want_entropy = token_logprobs(model, batch, temperature=0.9, with_entropy=True)
        with host_free():  # every position's logits, kept by the mask
            got, got_entropy = token_logprobs(model, padded, temperature=0.9, with_entropy=True)
    torch.testing.assert_close(got[:n], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_entropy[:n], want_entropy, rtol=0, atol=1e-5)
    assert got[n:].eq(0).all()
    total = int(batch.mask.sum())
    loss, m = policy_terms(want, batch.old_logprobs, batch.advantages, batch.mask, num_tokens=total)
    loss_p, m_p = policy_terms(got, padded.old_logprobs, padded.advantages, padded.mask,
                               num_tokens=torch.tensor(float(total)))
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-7)
    for k in m:
        torch.testing.assert_close(m_p[k].double(), m[k].double(), rtol=1e-5, atol=1e-7, msg=k)


class _Stub(nn.Module):
    """A model with no ops of its own to check (those are tests/ops/test_host_free_ops.py's)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, input_ids, cu_seqlens=None):
        return self.head(self.embed(input_ids)).float()


def test_the_padded_update_body_reads_nothing_on_the_host():
    trainer = update_only_trainer(graphs=True, kl_coef=0.1)
    trainer.model, trainer.ref_model = _Stub(), _Stub().requires_grad_(False)
    rows = [pack_trajectories(*random_trajectories(seed, lengths)) for seed, lengths in enumerate(STEPS[:2])]
    batches = [pad_rl_batch(b, tokens=64, docs=8, pad_id=2) for b in rows]
    with host_free(), no_host_reads():
        out = trainer._train_rows(batches, torch.tensor(40.0))
    assert set(out) == {"loss", "pg_loss", "ratio_mean", "ratio_max", "clip_fraction", "clip_low_fraction",
                        "clip_high_fraction", "behaviour_kl", "kl", "entropy"}
    assert all(v.dim() == 0 for v in out.values()) and trainer.model.head.weight.grad is not None


@pytest.mark.parametrize("cls, changes", [(RLTrainer, {}), (RLTrainer, {"kl_coef": 0.1}), (DistillTrainer, {})],
                         ids=["rl", "rl-kl", "distill"])
def test_optimize_through_the_graph_step_trains_as_eager(monkeypatch, cls, changes):
    """Distillation: the teacher scores the padded rows eagerly, the update is the graph's."""
    monkeypatch.setattr(rl_trainer, "TRAIN_ROW_TOKENS", 40)  # several rows a step
    # AdamW's first steps scale ulp differences of gradients near its eps by the lr: 1e-3 keeps them under 1e-5
    eager = update_only_trainer(graphs=False, cls=cls, lr=1e-3, **changes)
    graphed = update_only_trainer(graphs=True, cls=cls, lr=1e-3, **changes)
    assert isinstance(graphed.graphs, GraphStep) and graphed.optimizer.capturable and not graphed.share_prompts
    # three steps of varied rows, then one that finished no episode (after a replay: no stale gradients)
    steps = [random_trajectories(n, lengths, version=n) for n, lengths in enumerate(STEPS)] + [([], [])]
    for n, (trajectories, advantages) in enumerate(steps):
        eager.rollouts.policy_version = graphed.rollouts.policy_version = n
        want, got = eager.optimize(trajectories, advantages), graphed.optimize(trajectories, advantages)
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, rel=1e-5, abs=2e-6), n  # metrics are rounded to 1e-6
        assert cls is not DistillTrainer or got["teacher_gap"] != 0
    assert {key[0] for key in graphed.graphs.graphs} == {1, 2}  # one graph per row count and shape
    assert graphed.step == eager.step == 4
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_rl_refuses_captured_steps_only_for_what_it_cannot_capture():
    trainer = update_only_trainer(graphs=False)
    trainer.world = World(0, 1, torch.device("cuda"))  # the refusal reads settings and the device's kind only
    ready = dataclasses.replace(trainer.s, cuda_graphs=True)
    trainer.s = ready
    assert trainer._graph_refusal() is None  # its own train_step replays its update
    for change, why in (({"batch_invariant": True}, "--batch-invariant"), ({"qat": True}, "--qat"),
                        ({"cuda_graphs": False}, "--no-cuda-graphs")):
        trainer.s = dataclasses.replace(ready, **change)
        assert why in trainer._graph_refusal()
    trainer.s, trainer.world = ready, World(0, 2, torch.device("cuda"))
    assert trainer._graph_refusal() == "under torchrun"
