"""Data + FSDP2 parallelism, applied from outside the model (the model files stay single-device).

`torchrun --nproc-per-node N -m k3 train ...` sets WORLD_SIZE/RANK/LOCAL_RANK; we then join a
process group (gloo on CPU, NCCL on CUDA), shard every decoder layer and then the root with
`torch.distributed.fsdp.fully_shard` (parameters, gradients and optimizer state sharded on dim 0;
each layer's weights are all-gathered for its forward and backward only), and give each rank its
slice of every global batch. Gradients are averaged across ranks by FSDP's reduce-scatter.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from k3 import device as k3_device
from k3.train.errors import TrainError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def parse_device(device: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, checked against this machine; TrainError otherwise."""
    try:
        return k3_device.parse_device(device)
    except ValueError as e:
        raise TrainError(str(e)) from None


def init_world(device: str) -> World:
    """The process's place in the job; starts the process group when launched by torchrun."""
    dev = parse_device(device)
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise TrainError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None
    if size == 1:
        return World(0, 1, dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    return World(dist.get_rank(), dist.get_world_size(), dev)


def shard_model(model: torch.nn.Module, world: World, *, ep: int = 1, dp: int | None = None,
                ep_plan: str = "balanced") -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (the bulk of the weights), then the root (embedding,
    final norm, output AttnRes read, lm_head), as torchtitan does.

    With ep > 1 the world is a (dp, ep) mesh: every rank still reads its own data; each MoE layer's
    routed experts are DTensors sharded on dim 0 over "ep" and FSDP2-sharded over "dp", tokens
    reach them by all-to-all (k3/parallel/expert_parallel.py, MoonEP's balanced plan by default);
    everything else is FSDP2-sharded over all ranks. Expert gradients are summed over their EP
    group by the all-to-all backward, so they are scaled by 1/ep before FSDP averages them over dp."""
    dp = world.size // ep if dp is None else dp
    if ep < 1 or dp < 1 or ep * dp != world.size:
        raise TrainError(f"--ep {ep} x --dp {dp} must equal the world size {world.size}")
    everyone = init_device_mesh(world.device.type, (world.size,))
    if ep > 1:
        from torch.distributed.tensor import Shard, distribute_tensor

        from k3.model.experts import RoutedExperts
        from k3.parallel.expert_parallel import ExpertParallel

        mesh = init_device_mesh(world.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
        try:
            ExpertParallel(mesh["ep"].get_group(), plan=ep_plan, grad_scale=1.0 / ep).apply(model)
        except ValueError as e:
            raise TrainError(str(e)) from None
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                for name in ("w1", "w3", "w2"):
                    p = getattr(module, name)
                    setattr(module, name, torch.nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
                fully_shard(module, mesh=mesh["dp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=everyone)
    fully_shard(model, mesh=everyone)
    return model


def shard_multimodal(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """FSDP2 for K3ForConditionalGeneration: the text model as `shard_model` shards it, with its
    token embedding a unit of its own (the image rows are written over the embeddings before the
    text model's forward, outside its root unit), one unit per tower block, the tower's root (patch
    embedding, position table, final norm), the projector, then the wrapper."""
    everyone = init_device_mesh(world.device.type, (world.size,))
    fully_shard(model.language_model.model.embed_tokens, mesh=everyone)
    shard_model(model.language_model, world)
    for block in model.vision_tower.encoder.blocks:
        fully_shard(block, mesh=everyone)
    fully_shard(model.vision_tower, mesh=everyone)
    fully_shard(model.mm_projector, mesh=everyone)
    fully_shard(model, mesh=everyone)
    return model


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, also when gradients live on different device meshes (routed experts
    on the (dp, ep) mesh, the rest on all ranks), whose norms torch cannot stack: each mesh's norm
    is computed and reduced apart, then combined. Returns the total norm."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    meshes = {p.grad.device_mesh if isinstance(p.grad, DTensor) else None for p in params}
    if len(meshes) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.zeros((), device=params[0].grad.device)
    # the same order on every rank (a set's order is not): each norm's reduction is a collective
    for mesh in sorted(meshes, key=lambda m: (-1,) if m is None else (m.ndim, *m.mesh.flatten().tolist())):
        grads = [p.grad for p in params if (p.grad.device_mesh if isinstance(p.grad, DTensor) else None) == mesh]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = total + norm.float() ** 2
    total = total.sqrt()
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    for p in params:
        p.grad.mul_(coef)
    return total


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def broadcast_object(obj, world: World):
    """Rank 0's `obj` (picklable, built by our own code) on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, world: World) -> bool:
    """`flag` on any rank (e.g. one rank still decoding while the others are done)."""
    if not world.distributed:
        return flag
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=world.device), world).item())


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
