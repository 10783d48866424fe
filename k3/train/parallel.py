"""Data + FSDP2 parallelism, applied from outside the model (the model files stay single-device).

`torchrun --nproc-per-node N -m k3 train ...` sets WORLD_SIZE/RANK/LOCAL_RANK; we then join a
process group (gloo on CPU, NCCL on CUDA), shard every decoder layer and then the root with
`torch.distributed.fsdp.fully_shard` (parameters, gradients and optimizer state sharded on dim 0;
each layer's weights are all-gathered for its forward and backward only), and give each rank its
slice of every global batch. Gradients are averaged across ranks by FSDP's reduce-scatter.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from k3.train.errors import TrainError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def parse_device(device: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, checked against this machine; TrainError otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise TrainError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise TrainError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"--device {device} requested but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TrainError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


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


def shard_model(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (the bulk of the weights), then the root (embedding,
    final norm, output AttnRes read, lm_head), as torchtitan does."""
    mesh = init_device_mesh(world.device.type, (world.size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
