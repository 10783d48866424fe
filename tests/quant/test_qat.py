"""QAT (DESIGN §9): MXFP4 weights + MXFP8 activations on routed experts only,
straight-through gradients, and an export that serves exactly what was trained."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from k3.checkpoint.packed import save_packed
from k3.checkpoint.pretrained import load_pretrained
from k3.model.experts import RoutedExperts
from k3.model.transformer import K3ForCausalLM
from k3.quant.mx import E2M1, E4M3, fake_quantize
from k3.quant.qat import MXQATExperts, apply_qat, fake_quantize_ste, reused_weight_quantization
from tests.helpers import assert_rel_close
from tests.helpers.models import randomized, small_config


def test_apply_qat_converts_routed_experts_only():
    model = randomized(K3ForCausalLM(small_config()))
    cfg = model.config
    before = dict(model.named_parameters())
    modules_before = {n: type(m) for n, m in model.named_modules()}
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    dense_logits = model(ids)
    converted = apply_qat(model)
    assert converted == sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    for name, module in model.named_modules():
        # only the expert banks change class; attention, latent projections, shared experts, router stay
        want = MXQATExperts if modules_before[name] is RoutedExperts else modules_before[name]
        assert type(module) is want, name
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[n] is after[n] for n in before), "same Parameter objects"
    assert apply_qat(model) == 0, "idempotent"
    assert not torch.equal(model(ids), dense_logits)
    with pytest.raises(ValueError, match="no routed experts"):
        apply_qat(nn.Sequential(nn.Linear(32, 32)))


def test_straight_through_estimator():
    x = (torch.randn(4, 64) * 500).requires_grad_()  # large enough that E4M3 saturates some elements
    y = fake_quantize_ste(x, E4M3, "floor")
    assert torch.equal(y, fake_quantize(x.detach(), E4M3, "floor"))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g), "identity gradient, saturated elements included"


def test_reused_weight_quantization_follows_every_weight_update():
    """Inside the context an autograd-free forward quantizes once per weight version: the same
    tensors come back until an optimizer step or a copy_ moves the weights; a gradient-mode forward
    and the code outside the context quantize afresh."""
    model = randomized(K3ForCausalLM(small_config()))
    apply_qat(model)
    bank = next(m for m in model.modules() if isinstance(m, MXQATExperts))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    fresh = lambda: [fake_quantize(w.detach(), E2M1, "ceil") for w in (bank.w1, bank.w3, bank.w2)]
    with torch.no_grad():
        plain = model(ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with reused_weight_quantization(model):
        with torch.no_grad():
            first = bank.weights()
            assert all(torch.equal(a, b) for a, b in zip(first, fresh()))
            assert all(a is b for a, b in zip(bank.weights(), first)), "reused while the weights stand"
            assert torch.equal(model(ids), plain), "the same logits as quantizing every time"
        with reused_weight_quantization(model):  # nested: the inner one leaves the copies alone
            pass
        with torch.no_grad():
            assert bank.weights()[0] is first[0]
        grad_mode = bank.weights()
        assert all(w.requires_grad for w in grad_mode), "gradient-mode forwards quantize with the STE"
        model(ids).float().pow(2).mean().backward()
        opt.step()  # in place: bumps the Parameters' version counters
        with torch.no_grad():
            stepped = bank.weights()
            assert stepped[0] is not first[0] and all(torch.equal(a, b) for a, b in zip(stepped, fresh()))
            bank.w2.copy_(torch.randn_like(bank.w2))
            assert torch.equal(bank.weights()[2], fresh()[2])
    assert "_reused" not in bank.__dict__, "the copies go with the context"
    with torch.no_grad():
        assert bank.weights()[0] is not bank.weights()[0]


def _expert_reference(x, w1, w3, w2, act):
    """One expert, written out: an MXFP8 (E4M3) straight-through cast on every matmul input."""
    q = lambda t: fake_quantize_ste(t, E4M3, "floor")
    h = act(F.linear(q(x), w1), F.linear(q(x), w3))
    return F.linear(q(h), w2)


def test_qat_experts_forward_and_straight_through_gradients():
    cfg = small_config(num_experts=3)
    bank = RoutedExperts(cfg, 64, 96)
    bank.reset_parameters()
    act = bank.act
    MXQATExperts.convert(bank)
    counts = torch.tensor([2, 0, 3])
    x = (torch.randn(5, 64) * 3).requires_grad_()
    y = bank.run_sorted(x, counts)
    # forward: each expert computes with fq_MXFP4 weights and fq_E4M3 inputs
    wq = [fake_quantize(w.detach(), E2M1, "ceil").requires_grad_() for w in (bank.w1, bank.w3, bank.w2)]
    xr = x.detach().requires_grad_()
    rows = [_expert_reference(xr[:2], wq[0][0], wq[1][0], wq[2][0], act),
            _expert_reference(xr[2:], wq[0][2], wq[1][2], wq[2][2], act)]
    y_ref = torch.cat(rows)
    assert torch.equal(y, y_ref)
    # backward: the gradients at the quantized point, passed straight through the casts
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    # (the bank casts x once for w1 and w3, the reference twice: sums differ in the last bits)
    assert_rel_close("dx", xr.grad, x.grad, 1e-6)
    for name, w, ref in zip(("dw1", "dw3", "dw2"), (bank.w1, bank.w3, bank.w2), wq):
        assert_rel_close(name, ref.grad, w.grad, 1e-6)
    assert bank.w1.grad[1].abs().sum() == 0, "expert 1 got no tokens"
    with pytest.raises(ValueError, match="divisible by 32"):
        MXQATExperts.convert(RoutedExperts(cfg, 48, 64))


# ----------------------------------------------------------------------- a short QAT run
def _run(settings_kwargs: dict, qat: bool):
    from k3.train.trainer import Trainer, TrainSettings

    trainer = Trainer(TrainSettings(**settings_kwargs), progress=False, log=lambda *a, **k: None)
    if qat:
        apply_qat(trainer.model)  # what `k3 train --qat` does after building the model
    val_before = trainer.evaluate(settings_kwargs["eval_windows"])["val_loss"]
    losses = [trainer.train_step()["loss"] for _ in range(trainer.s.steps)]
    return trainer, losses, val_before


RUNS = {
    # k3-tiny itself: the acceptance run (minutes on a busy 2-core CPU)
    "k3-tiny": pytest.param({"config": "k3-tiny", "steps": 20, "batch_size": 4, "seq_len": 64}, marks=pytest.mark.slow),
    # the same check on the test suite's small config, fast enough for every run
    "small": {"config": None, "steps": 3, "batch_size": 2, "seq_len": 32},
}


def _small_corpus(path):
    """40 KB of the bundled corpus as 40 documents: the tokenizer trains in a blink."""
    from k3.data.corpus import load_documents

    text = "".join(d.text for d in load_documents())[:40_000]
    path.write_text("".join(json.dumps({"id": f"doc{i}", "text": text[i * 1000:(i + 1) * 1000]}) + "\n"
                            for i in range(40)))
    return str(path)


@pytest.mark.parametrize("run", list(RUNS.values()), ids=list(RUNS))
def test_qat_run_tracks_dense_and_export_serves_it_exactly(run, request, tmp_path, tmp_path_factory):
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the k3-tiny acceptance run takes minutes: select it with -m slow")
    eval_windows = 2
    common = dict(run, seed=0, lr=4e-3, eval_windows=eval_windows,
                  cache_dir=str(tmp_path_factory.getbasetemp() / "k3-cache"))
    if common["config"] is None:
        common["config"] = str(small_config(vocab_size=512, num_hidden_layers=4, kda_layers=[], full_attn_layers=[], num_experts=4).save(tmp_path / "config"))
        common["data"] = _small_corpus(tmp_path / "corpus.jsonl")
    _, dense_losses, _ = _run({**common, "out": str(tmp_path / "dense")}, qat=False)
    trainer, qat_losses, qat_val_before = _run({**common, "out": str(tmp_path / "qat")}, qat=True)

    assert all(math.isfinite(l) for l in dense_losses + qat_losses)
    qat_val = trainer.evaluate(eval_windows)["val_loss"]
    # on the same held-out windows (train losses of a few steps are on different batches)
    assert qat_val < qat_val_before, "QAT training learns"
    tail = 3
    dense_end, qat_end = sum(dense_losses[-tail:]) / tail, sum(qat_losses[-tail:]) / tail
    assert abs(qat_end - dense_end) / dense_end < 0.03, (dense_losses, qat_losses)


    # export the trained model (exact dtype), load it, serve it with the same MXFP8 activation cast
    save_packed(trainer.model, tmp_path / "export", dtype=None)
    served = load_pretrained(tmp_path / "export")
    apply_qat(served)  # re-quantizing MXFP4 values is the identity; this adds the activation cast
    trainer.model = served
    assert trainer.evaluate(eval_windows)["val_loss"] == qat_val

    # the published form (bf16 elsewhere, W4A16 as its quantization_config says) stays close
    save_packed(served, tmp_path / "published")
    trainer.model = load_pretrained(tmp_path / "published")
    assert abs(trainer.evaluate(eval_windows)["val_loss"] - qat_val) / qat_val < 0.02
