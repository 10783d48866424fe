"""The one way a training verb transforms its model, in one order (DESIGN §14.3), torchtitan-style:
converters first, then the parallelisms, each on the module the next one will see.

1. QAT (k3/quant/qat.py): each routed-expert bank becomes MXQATExperts. First, so everything after
   wraps the bank that trains (EP refuses a quantized bank rather than drop its quantization).
2. CP (k3/parallel/context_parallel.py): the KDA and MLA mixers run over a sequence shard. No verb
   sets it yet; a caller that shards sequences passes its ContextParallel.
3. EP, then FSDP2 (k3/train/parallel.py `shard_model`): the expert banks over the "ep" mesh, then
   one FSDP unit per decoder layer and the root, under torchrun only.
4. compile (k3/regional_compile.py): last, so it traces the forwards CP and EP installed; its
   regions (norms, mixer, FFN) sit inside FSDP's per-layer units, so the all-gathers stay outside
   the graphs.

A multimodal model (K3ForConditionalGeneration) takes the same steps on its text model, FSDP2 over
the tower and projector as well (`shard_multimodal`).
"""
from __future__ import annotations

from torch import nn

from k3.model.multimodal import K3ForConditionalGeneration
from k3.parallel.context_parallel import ContextParallel
from k3.quant.qat import apply_qat
from k3.regional_compile import compile_regions
from k3.train.parallel import World, shard_model, shard_multimodal

ORDER = ("qat", "cp", "ep + fsdp", "compile")


def apply_transforms(model: nn.Module, settings, world: World, *, cp: ContextParallel | None = None) -> nn.Module:
    """`model` (placed on its device) with the transforms `settings` asks for (`qat`, `compile`, and
    `ep` / `dp` / `ep_plan` where the verb has them), in ORDER; returns the model to train."""
    multimodal = isinstance(model, K3ForConditionalGeneration)
    text = model.language_model if multimodal else model
    if settings.qat:
        apply_qat(text)
    if cp is not None:
        cp.apply(text)
    if world.distributed:
        if multimodal:
            model = shard_multimodal(model, world)
        else:  # verbs without expert-parallel settings shard with FSDP2 alone
            model = shard_model(model, world, ep=getattr(settings, "ep", 1), dp=getattr(settings, "dp", None),
                                ep_plan=getattr(settings, "ep_plan", "balanced"))
    if settings.compile:
        compile_regions(text)
    return model
