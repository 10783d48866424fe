"""QAT (SPEC §9; issue #6 acceptance 3): MXFP4 weights + MXFP8 activations on routed experts only,
straight-through gradients, and an export that serves exactly what was trained."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from k3.model.transformer import K3ForCausalLM
from k3.quant.mx import E2M1, E4M3, fake_quantize
from k3.quant.packed_checkpoint import load_packed, save_packed
from k3.quant.qat import MXQATLinear, apply_qat
from k3.quant.targets import is_routed_expert_linear
from tests.test_model import randomized, small_config


def test_apply_qat_swaps_routed_experts_only():
    model = randomized(K3ForCausalLM(small_config()))
    cfg = model.config
    before = dict(model.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    dense_logits = model(ids)
    swapped = apply_qat(model)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert swapped == moe_layers * cfg.num_experts * 3
    for name, module in model.named_modules():
        assert isinstance(module, MXQATLinear) == is_routed_expert_linear(name), name
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[n] is after[n] for n in before), "same Parameter objects"
    assert apply_qat(model) == 0, "idempotent"
    assert not torch.equal(model(ids), dense_logits)
    with pytest.raises(ValueError, match="no routed-expert linears"):
        apply_qat(nn.Sequential(nn.Linear(32, 32)))


def test_qat_linear_forward_and_straight_through_gradients():
    linear = nn.Linear(64, 96, bias=False)
    qat = MXQATLinear.from_linear(linear)
    x = (torch.randn(5, 64) * 3).requires_grad_()
    y = qat(x)
    # forward: exactly fq_E4M3(x) @ fq_MXFP4(W)^T
    xq = fake_quantize(x.detach(), E4M3, "floor").requires_grad_()
    wq = fake_quantize(linear.weight.detach(), E2M1, "ceil").requires_grad_()
    y_ref = F.linear(xq, wq)
    assert torch.equal(y, y_ref)
    # backward: the gradients at the quantized point, passed straight through
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, xq.grad)
    assert torch.equal(qat.weight.grad, wq.grad)
    with pytest.raises(ValueError, match="divisible by 32"):
        MXQATLinear.from_linear(nn.Linear(48, 8))


# ----------------------------------------------------------------------- a short QAT run
def _run(settings_kwargs: dict, qat: bool):
    from k3.train.trainer import Trainer, TrainSettings

    trainer = Trainer(TrainSettings(**settings_kwargs), progress=False, log=lambda *a, **k: None)
    if qat:
        apply_qat(trainer.model)  # what `k3 train --qat` does after building the model
    losses = [trainer.train_step()["loss"] for _ in range(trainer.s.steps)]
    return trainer, losses


RUNS = {
    # k3-tiny itself: the acceptance run (minutes on a busy 2-core CPU)
    "k3-tiny": pytest.param(dict(config="k3-tiny", steps=20, batch_size=4, seq_len=64), marks=pytest.mark.slow),
    # the same check on the test suite's small config, fast enough for every run
    "small": dict(config=None, steps=4, batch_size=2, seq_len=32),
}


def _small_corpus(path):
    """40 KB of the bundled corpus as 40 documents: the tokenizer trains in a blink."""
    from k3.data.corpus import load_documents

    text = "".join(d.text for d in load_documents())[:40_000]
    path.write_text("".join(json.dumps({"id": f"doc{i}", "text": text[i * 1000:(i + 1) * 1000]}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.mark.parametrize("run", list(RUNS.values()), ids=list(RUNS))
def test_qat_run_tracks_dense_and_export_serves_it_exactly(run, tmp_path, tmp_path_factory):
    eval_windows = 4
    common = dict(run, seed=0, lr=4e-3, eval_windows=eval_windows,
                  cache_dir=str(tmp_path_factory.getbasetemp() / "k3-cache"))
    if common["config"] is None:
        common["config"] = str(small_config(vocab_size=512, num_hidden_layers=4, kda_layers=[], full_attn_layers=[], num_experts=4).save(tmp_path / "config"))
        common["data"] = _small_corpus(tmp_path / "corpus.jsonl")
    _, dense_losses = _run({**common, "out": str(tmp_path / "dense")}, qat=False)
    trainer, qat_losses = _run({**common, "out": str(tmp_path / "qat")}, qat=True)

    assert all(math.isfinite(l) for l in dense_losses + qat_losses)
    assert qat_losses[-1] < qat_losses[0], "QAT training learns"
    tail = 3
    dense_end, qat_end = sum(dense_losses[-tail:]) / tail, sum(qat_losses[-tail:]) / tail
    assert abs(qat_end - dense_end) / dense_end < 0.03, (dense_losses, qat_losses)

    qat_val = trainer.evaluate(eval_windows)["val_loss"]

    # export the trained model (exact dtype), load it, serve it with the same MXFP8 activation cast
    save_packed(trainer.model, tmp_path / "export", dtype=None)
    served = load_packed(tmp_path / "export")
    apply_qat(served)  # re-quantizing MXFP4 values is the identity; this adds the activation cast
    trainer.model = served
    assert trainer.evaluate(eval_windows)["val_loss"] == qat_val

    # the published form (bf16 elsewhere, W4A16 as its quantization_config says) stays close
    save_packed(served, tmp_path / "published")
    trainer.model = load_packed(tmp_path / "published")
    assert abs(trainer.evaluate(eval_windows)["val_loss"] - qat_val) / qat_val < 0.02
