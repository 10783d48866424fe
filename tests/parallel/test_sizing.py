"""`k3 plan` (k3/parallel/sizing.py): its memory figures for k3-tiny on one CPU process agree with
what torch actually holds after a training step (parameters, gradients, optimizer state: exact
tensor bytes; activations: every distinct storage autograd saved, parameters excluded), and the
full K3 on 2048 GPUs plans in seconds."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from torch.nn import functional as F

from k3 import flops
from k3.config import load_config
from k3.model.params import count_parameters
from k3.model.transformer import K3ForCausalLM
from k3.parallel.sizing import GPUS, Layout, Workload, _SavedBytes, optimizer_rule, size_layout
from k3.train.muon import PerHeadMuon, param_groups
from tests.helpers.train import REPO

GiB = 1024 ** 3


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_tiny_memory_matches_torch_within_10_percent():
    config = load_config("k3-tiny")
    model = K3ForCausalLM(config)
    optimizer = PerHeadMuon(param_groups(model, config, weight_decay=0.1), lr=1e-3)
    # the trainer's micro-batch: windows of 256 tokens packed into one row (4 of its default 8)
    ids = torch.randint(0, config.vocab_size, (1, 1024))
    cu = torch.arange(0, 1025, 256)
    saved = _SavedBytes({t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())})
    with saved:
        loss = F.cross_entropy(model(ids, cu_seqlens=cu)[0], ids[0], reduction="sum")
    loss.backward()
    optimizer.step()
    measured = {"weights": _nbytes(model.parameters()),
                "grads": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
                "optimizer": _nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
                "activations": saved.bytes}
    work = Workload(seq_len=1024, global_tokens=1024, training_dtype="fp32", checkpointing=False)
    planned = size_layout(config, Layout(), GPUS["cpu"], work).memory
    for key, value in measured.items():
        assert abs(planned[key] * GiB - value) <= 0.10 * value, f"{key}: plan {planned[key] * GiB:.0f}, torch {value}"
    total = sum(measured.values())
    assert abs(planned["total"] * GiB - total) <= 0.10 * total


def test_optimizer_rule_matches_param_groups():
    for preset in ("k3-tiny", "k3-1b"):
        config = load_config(preset)
        with torch.device("meta"):
            model = K3ForCausalLM(config)
        for group in param_groups(model, config, weight_decay=0.1):
            for name, p in zip(group["param_names"], group["params"]):
                assert optimizer_rule(name, p) == group["kind"], f"{preset} {name}: {group['kind']}"


def test_flop_model_is_the_stated_formula():
    """docs/BENCHMARKS.md ("Method", "MFU"): 6 N_active + per MLA layer 3 T H (d_qk + d_v) + per KDA
    layer 3 H (6 d^2 + 3 C d + C^2)."""
    config, T = load_config("k3-1b"), 4096
    got = flops.train_flops_per_token(config, T)
    active = count_parameters(config)["active"]
    assert round(active / 1e6, 1) == 253.1  # the figure docs/BENCHMARKS.md states
    d, C, H = config.kda_head_dim, config.kda_chunk_size, config.kda_num_heads
    parts = {"matmul_6N": 6 * active,
             "mla_attention": config.num_mla_layers * 3 * T * config.num_attention_heads
             * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim),
             "kda_recurrence": config.num_kda_layers * 3 * H * (6 * d * d + 3 * C * d + C * C)}
    assert got == {"active_params": active, **parts, "total": sum(parts.values())}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_and_bench_count_flops_with_one_function(checkpointing):
    """`k3 plan`'s compute time is tokens x k3.flops.train_flops_per_token (8/6 of it when the
    forward is recomputed), and the GPU benchmark's MFU uses the same functions, not copies."""
    import bench.gpu_bench as bench

    for name in ("kda_flops_per_token", "causal_attention_flops", "mla_flops_per_token", "train_flops_per_token"):
        assert getattr(bench, name) is getattr(flops, name), name
    config, T = load_config("k3-tiny"), 128
    work = Workload(seq_len=T, global_tokens=2 * T, checkpointing=checkpointing)
    sizing = size_layout(config, Layout(dp=2), GPUS["cpu"], work)  # one sequence per GPU, no pipeline
    passes = 8 if checkpointing else 6
    expected = T * flops.train_flops_per_token(config, T)["total"] * passes / 6 / (GPUS["cpu"].bf16_tflops * 1e12
                                                                                    * work.mfu)
    assert sizing.micro_batches == 1 and sizing.time["compute"] == pytest.approx(expected, rel=1e-12)


def test_plan_cli_tiny(capsys):
    from k3.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--threads", "1", "plan", "--config", "k3-tiny", "--gpus", "2", "--gpu", "cpu", "--seq-len", "128",
              "--global-tokens", "256"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "| DP1 EP2 CP1 PP1 |" in out and "| DP2 EP1 CP1 PP1 |" in out, out


@pytest.mark.slow
def test_plan_full_k3_on_2048_gpus_in_seconds():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "k3", "--threads", "1", "plan", "--config", "k3", "--gpus", "2048"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| DP")]
    assert rows and "no fit" not in rows[0], proc.stdout
    assert elapsed < 60, f"k3 plan took {elapsed:.0f} s"
