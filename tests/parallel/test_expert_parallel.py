"""Expert parallelism (k3/parallel/expert_parallel.py) over 4 gloo processes: a Stable LatentMoE
layer with its 16 experts split over EP=4 matches one process within 1e-5 (outputs, input and
every parameter gradient), with plain placement and with MoonEP's balanced plan under a router
skewed so that one expert takes every token (the plan then copies it to every rank, and each rank
runs exactly its N*k pairs)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.config import load_config
from k3.model.moe import StableLatentMoE
from tests.helpers import assert_rel_close

WORLD, N = 4, 24  # tokens per rank
TOL = 1e-5


def _layer():
    torch.manual_seed(0)
    moe = StableLatentMoE(load_config("k3-tiny"))
    with torch.no_grad():
        moe.gate.e_score_correction_bias[5] = 10.0  # every token's first choice: expert 5 (home rank 1)
    return moe


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * N, 128, generator=g)
    return x, torch.cos(torch.arange(WORLD * N * 128, dtype=torch.float32)).view(WORLD * N, 128)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from k3.parallel.expert_parallel import ExpertParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        x_full, proj = _inputs()
        results = {}
        for plan in ("home", "balanced"):
            moe = _layer()
            ep = ExpertParallel(plan=plan)
            ep.apply(moe)
            x = x_full[rank * N:(rank + 1) * N].clone().requires_grad_(True)
            y = moe(x)
            (y * proj[rank * N:(rank + 1) * N]).sum().backward()
            grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g)
            ys, xg = [torch.empty_like(y) for _ in range(WORLD)], [torch.empty_like(x) for _ in range(WORLD)]
            dist.all_gather(ys, y.detach())
            dist.all_gather(xg, x.grad)
            placement = ep.last_placement
            results[plan] = {"out": torch.cat(ys), "x_grad": torch.cat(xg), "grads": grads,
                             "rank_load": placement.rank_load(), "guests": placement.guests}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "ep.pt"))
    finally:
        dist.destroy_process_group()


def test_ep4_matches_one_process(tmp_path):
    # forked, not spawned: 4 workers each importing torch and k3 again took most of the test on 2 cores
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="fork")
    got = torch.load(tmp_path / "ep.pt")
    moe = _layer()
    x, proj = _inputs()
    x.requires_grad_(True)
    y = moe(x)
    (y * proj).sum().backward()
    for plan, res in got.items():
        assert_rel_close(f"{plan} output", y.detach(), res["out"], TOL)
        assert_rel_close(f"{plan} input grad", x.grad, res["x_grad"], TOL)
        for name, p in moe.named_parameters():
            assert_rel_close(f"{plan} grad {name}", p.grad, res["grads"][name], TOL)
    k = moe.gate.top_k
    assert got["home"]["rank_load"].tolist()[1] > N * k  # expert 5's home rank is overloaded
    assert (got["balanced"]["rank_load"] == N * k).all()  # the plan: exactly N*k pairs everywhere
    assert sum(5 in g for g in got["balanced"]["guests"]) >= 1
