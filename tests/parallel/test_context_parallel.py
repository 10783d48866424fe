"""Context parallelism (k3/parallel/context_parallel.py, DESIGN §14.1) over 4 gloo processes matches
one process within 1e-5 (relative RMSE): a KDA layer (KCP), an MLA layer and the whole k3-tiny
model, outputs and every gradient, on a packed row whose documents cross rank boundaries (one
covers a whole rank and continues into the next, one starts exactly at a rank's edge, one is a
single token): 4096 tokens under `-m slow` (about a minute on 2 cores), 512 in the default run.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

from k3.config import load_config
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.transformer import K3ForCausalLM
from tests.helpers import assert_rel_close

WORLD = 4
# doc [700, 2900) covers rank 1 whole and continues into rank 2; 3072 starts exactly at rank 3's edge
ROWS = {4096: torch.tensor([0, 700, 2900, 3072, 4000, 4001, 4096]),
        512: torch.tensor([0, 90, 360, 384, 500, 501, 512])}
TOL = 1e-5


def _config():
    return load_config("k3-tiny")


def _build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    config = _config()
    if kind == "kda":
        return KimiDeltaAttention(config, 0)
    if kind == "mla":
        return GatedMLA(config, 3)
    return K3ForCausalLM(config)


def _inputs(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    config = _config()
    x = torch.randn(1, T, config.hidden_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=g)
    return x, ids


def _weight_for(out: torch.Tensor, start: int) -> torch.Tensor:
    """A fixed projection of a layer's output (by global position) to a scalar to differentiate."""
    flat = torch.arange(out.numel(), dtype=torch.float32).view_as(out) + start * out.shape[-1]
    return torch.cos(flat)


def _worker(rank: int, init_file: str, out_dir: str, kinds: tuple, T: int) -> None:
    from k3.parallel.context_parallel import ContextParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        x_full, ids_full = _inputs(T)
        results = {}
        for kind in kinds:
            module = _build(kind)
            cp = ContextParallel()
            cp.apply(module)
            ids, cu = cp.shard(ids_full, ROWS[T])
            s = cp.segment
            x = x_full[:, s.start:s.start + s.length].clone().requires_grad_(True)
            if kind == "model":
                logits = module(ids, cu_seqlens=cu)
                targets = ids_full.roll(-1, 1)[:, s.start:s.start + s.length]
                out, loss = logits, F.cross_entropy(logits[0], targets[0], reduction="sum")
            else:
                out = module(x, cu_seqlens=cu)
                loss = (out * _weight_for(out, s.start)).sum()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            for g in grads.values():
                dist.all_reduce(g)
            outs = [torch.empty_like(out) for _ in range(WORLD)]
            dist.all_gather(outs, out.detach().contiguous())
            xg = [torch.empty_like(x) for _ in range(WORLD)]
            if kind != "model":
                dist.all_gather(xg, x.grad.contiguous())
            results[kind] = {"out": torch.cat(outs, 1), "grads": grads,
                             "x_grad": torch.cat(xg, 1) if kind != "model" else None}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "cp.pt"))
    finally:
        dist.destroy_process_group()


def _reference(kind: str, T: int):
    x, ids = _inputs(T)
    CU = ROWS[T]
    module = _build(kind)
    x = x.clone().requires_grad_(True)
    if kind == "model":
        logits = module(ids, cu_seqlens=CU)
        loss = F.cross_entropy(logits[0], ids.roll(-1, 1)[0], reduction="sum")
        out = logits
    else:
        out = module(x, cu_seqlens=CU)
        loss = (out * _weight_for(out, 0)).sum()
    loss.backward()
    return {"out": out.detach(), "grads": {n: p.grad for n, p in module.named_parameters() if p.grad is not None},
            "x_grad": x.grad if kind != "model" else None}


def test_split_row_pieces():
    from k3.parallel.context_parallel import split_row

    T, CU = 4096, ROWS[4096]
    seg = split_row(CU, T, 1, WORLD)
    assert seg.cu_seqlens.tolist() == [0, 1024] and seg.continues and seg.single_piece[1]
    seg = split_row(CU, T, 3, WORLD)
    assert seg.cu_seqlens.tolist() == [0, 928, 929, 1024] and not seg.continues
    seg = split_row(CU, T, 2, WORLD)
    assert seg.cu_seqlens.tolist() == [0, 852, 1024] and seg.continues and not seg.single_piece[2]


def test_cp4_matches_one_process_512(tmp_path):
    _check_cp(tmp_path, ("kda", "mla", "model"), 512)


@pytest.mark.slow
def test_cp4_matches_one_process_4k(tmp_path):
    _check_cp(tmp_path, ("kda", "mla", "model"), 4096)


def _check_cp(tmp_path, kinds: tuple, T: int):
    # forked, not spawned: 4 workers each importing torch and k3 again took most of the test on 2 cores
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path), kinds, T), nprocs=WORLD, join=True,
                       start_method="fork")
    got = torch.load(tmp_path / "cp.pt")
    for kind in kinds:
        ref = _reference(kind, T)
        assert_rel_close(f"{kind} output", ref["out"], got[kind]["out"], TOL)
        if ref["x_grad"] is not None:
            assert_rel_close(f"{kind} input grad", ref["x_grad"], got[kind]["x_grad"], TOL)
        assert ref["grads"].keys() == got[kind]["grads"].keys()
        for name, g in ref["grads"].items():
            assert_rel_close(f"{kind} grad {name}", g, got[kind]["grads"][name], TOL)
