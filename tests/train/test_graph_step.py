"""The captured training step's host side on CPU (k3/train/graph_step.py): fixed-shape padding,
buckets, and the step body run through GraphStep (host-free ops, padded rows, a capturable
optimizer, stats read back every few steps) training as the eager step does."""
from __future__ import annotations

import pytest
import torch

from k3.train.graph_step import GraphStep, doc_bucket, pad_batch, token_bucket, windowed
from k3.train.packing import IGNORE_INDEX, PackedBatch
from k3.train.trainer import Trainer
from tests.helpers.train import losses, quiet, tiny_settings


def test_buckets():
    assert [doc_bucket(d) for d in (1, 8, 9, 17, 100)] == [8, 8, 16, 32, 128]
    assert [token_bucket(n) for n in (256, 257, 2048, 2049, 3000)] == [256, 320, 2048, 2560, 3072]
    assert all(n <= token_bucket(n) <= n * 1.25 for n in range(1, 5000))


def test_pad_batch_adds_an_ignored_document_and_empty_ones():
    b = PackedBatch(torch.arange(5)[None], torch.arange(1, 6)[None], torch.tensor([0, 2, 5]))
    p = pad_batch(b, tokens=8, docs=8, pad_id=2)
    assert p.input_ids.tolist() == [[0, 1, 2, 3, 4, 2, 2, 2]]
    assert p.labels[0, 5:].tolist() == [IGNORE_INDEX] * 3 and p.labels[0, :5].tolist() == [1, 2, 3, 4, 5]
    assert p.cu_seqlens.tolist() == [0, 2, 5, 8, 8, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(b, tokens=4, docs=8, pad_id=2)
    with pytest.raises(ValueError, match="does not fit the bucket"):
        pad_batch(b, tokens=5, docs=1, pad_id=2)


def test_windowed_rows_start_a_document_at_every_window():
    row = PackedBatch(torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long),
                      torch.tensor([0, 3, 4, 8, 12]))
    assert windowed(row, 4) and not windowed(row, 3) and windowed(row, 12)


def test_graph_body_trains_as_the_eager_step(tmp_path, monkeypatch):
    eager = Trainer(tiny_settings(tmp_path, "eager", steps=4, eval_every=4, ckpt_every=4), progress=False, log=quiet)
    eager.train()
    monkeypatch.setattr(Trainer, "_graph_refusal", lambda self: None)  # CPU: GraphStep runs its body eagerly
    graphed = Trainer(tiny_settings(tmp_path, "graphed", steps=4, eval_every=4, ckpt_every=4), progress=False, log=quiet)
    assert isinstance(graphed.graphs, GraphStep) and graphed.optimizer.capturable
    graphed.train()
    assert all(key[-1] == 32 for key in graphed.graphs.graphs)  # whole 32-token windows: attended one by one
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # dynamo traces every region kind: ~20 s on 2 cores
def test_graph_body_with_compiled_regions_trains_as_the_eager_step(tmp_path, monkeypatch):
    """`--compile` with captured steps: the regions (traced here by dynamo's "eager" backend, in
    seconds; inductor's kernels are the GPU's business) run inside the host-free padded body."""
    from k3.regional_compile import compile_regions
    from k3.train import transforms

    torch._dynamo.reset()
    monkeypatch.setattr(transforms, "compile_regions", lambda model: compile_regions(model, backend="eager"))
    eager = Trainer(tiny_settings(tmp_path, "eager", steps=3, eval_every=3, ckpt_every=3), progress=False, log=quiet)
    eager.train()
    monkeypatch.setattr(Trainer, "_graph_refusal", lambda self: None)  # CPU: GraphStep runs its body eagerly
    graphed = Trainer(tiny_settings(tmp_path, "graphed", steps=3, eval_every=3, ckpt_every=3, compile=True),
                      progress=False, log=quiet)
    assert isinstance(graphed.graphs, GraphStep)
    graphed.train()
    assert losses(tmp_path / "graphed") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
