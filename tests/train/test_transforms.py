"""The model transforms a training verb applies (k3/train/transforms.py): QAT, CP, EP + FSDP2 and
compile, each only when asked, in ORDER, on the text model of a multimodal one too."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3.model.experts import RoutedExperts
from k3.model.multimodal import K3ForConditionalGeneration, K3MultimodalConfig
from k3.model.transformer import K3ForCausalLM
from k3.quant.qat import MXQATExperts
from k3.train import transforms
from k3.train.parallel import World
from tests.helpers.models import small_config
from tests.model.vision.helpers import tiny_config

CPU = torch.device("cpu")


def _settings(**kw):
    return SimpleNamespace(**{"qat": True, "compile": True, "ep": 2, "dp": 1, "ep_plan": "home", **kw})


@pytest.fixture
def calls(monkeypatch):
    """Each transform replaced by a recorder of (name, the module it got)."""
    seen = []
    monkeypatch.setattr(transforms, "apply_qat", lambda m: seen.append(("qat", m)))
    monkeypatch.setattr(transforms, "shard_model", lambda m, world, **kw: seen.append(("ep + fsdp", m, kw)) or m)
    monkeypatch.setattr(transforms, "shard_multimodal", lambda m, world: seen.append(("ep + fsdp", m)) or m)
    monkeypatch.setattr(transforms, "compile_regions", lambda m: seen.append(("compile", m)))
    return seen


def test_the_order_and_what_each_step_gets(calls):
    model = K3ForCausalLM(small_config())
    cp = SimpleNamespace(apply=lambda m: calls.append(("cp", m)))
    assert transforms.apply_transforms(model, _settings(), World(0, 2, CPU), cp=cp) is model
    assert tuple(c[0] for c in calls) == transforms.ORDER and all(c[1] is model for c in calls)
    assert calls[2][2] == {"ep": 2, "dp": 1, "ep_plan": "home"}

    calls.clear()  # one process, nothing asked: nothing done
    transforms.apply_transforms(model, _settings(qat=False, compile=False), World(0, 1, CPU))
    assert calls == []
    # a verb without expert-parallel settings (sft, rl) shards with FSDP2 alone
    transforms.apply_transforms(model, SimpleNamespace(qat=False, compile=False), World(0, 2, CPU))
    assert calls[0][2] == {"ep": 1, "dp": None, "ep_plan": "balanced"}


def test_a_multimodal_model_transforms_its_text_model(calls):
    text = small_config()
    model = K3ForConditionalGeneration(K3MultimodalConfig(text, tiny_config(text_hidden_size=text.hidden_size)))
    transforms.apply_transforms(model, _settings(), World(0, 2, CPU))
    assert [(c[0], c[1]) for c in calls] == [("qat", model.language_model), ("ep + fsdp", model),
                                             ("compile", model.language_model)]


def test_qat_for_real():
    """The real QAT (compile's own tests: tests/test_compile.py; importing inductor here would cost seconds)."""
    model = K3ForCausalLM(small_config())
    transforms.apply_transforms(model, _settings(compile=False), World(0, 1, CPU))
    banks = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert banks and all(isinstance(m, MXQATExperts) for m in banks)
