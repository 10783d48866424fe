"""The VL trainer's step through GraphStep on CPU (DESIGN §14.5): padded rows with their images'
grids as host metadata, the loss masked at every position, the two normalizers a device vector;
the steps train as the eager VL steps do, and the tower with a cached layout reads nothing back."""
from __future__ import annotations

import time

import pytest
import torch

from k3.model.kda import KimiDeltaAttention
from k3.model.vision import MoonViT, VisionConfig
from k3.ops.host_free import host_free
from k3.train import vl_trainer
from k3.train.graph_step import GraphStep
from k3.train.vl_data import pack_vl
from k3.train.vl_graph import pad_vl_batch
from k3.train.vl_trainer import VLTrainer
from tests.helpers.host_reads import allow_host_reads, no_host_reads
from tests.helpers.threads import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.helpers.train import quiet
from tests.train.test_vl_trainer import micro_settings

STEPS = 3


def _steps(root, name: str) -> tuple[VLTrainer, list[dict], list[bool]]:
    trainer = VLTrainer(micro_settings(root, name, steps=STEPS, vl_scenes=2, grad_accum=2, batch_size=2),
                        progress=False, log=quiet)
    records, pending, graphed = [], [], []
    for _ in range(STEPS):  # as Trainer.train: captured steps' stats read back at once, before an eager step's
        records.append(trainer.train_step())
        pending.append(records[-1])
        graphed.append("stats" in records[-1])
        if not graphed[-1] or len(records) == STEPS:
            trainer._flush_steps(pending, time.perf_counter(), None)
            pending = []
    return trainer, records, graphed


def test_vl_steps_through_the_graph_step_train_as_the_eager_steps(tmp_path, monkeypatch):
    eager, want, _ = _steps(tmp_path, "eager")
    assert eager.graphs is None
    monkeypatch.setattr(VLTrainer, "_graph_refusal", lambda self: None)  # CPU: GraphStep runs its body eagerly
    monkeypatch.setattr(vl_trainer, "MAX_GRAPH_SPAN", 150)  # rows of 160 tokens step eagerly, of 128 through the graph
    graphed, got, through_graph = _steps(tmp_path, "graphed")
    assert isinstance(graphed.graphs, GraphStep) and graphed.optimizer.capturable
    assert sorted(set(through_graph)) == [False, True]  # both paths, one after the other
    for key in graphed.graphs.graphs:  # a bucket per padded shape, each with the images' grids in its key
        assert key[-2] == ((("grids", ((1, 4, 4),)),),) * 2 and key[-1] is None  # rows attend whole
    for a, b in zip(want, got):
        for k in ("loss", "text_loss", "image_loss", "grad_norm", "max_load"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
        assert (b["step"], b["tokens"], b["images"], b["lr"]) == (a["step"], a["tokens"], a["images"], a["lr"])
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert any(n.startswith("vision_tower.") for n, _ in eager.model.named_parameters())

    # padding: an ignored document, off the VL mask, none of its tokens routed (pad ids)
    windows, scenes = graphed.rank_items()
    batch = pack_vl(graphed.train_data, windows[:1], 32, graphed.documents(scenes[:1]))
    n = batch.input_ids.shape[1]
    placeholder = graphed.mm_config.media_placeholder_token_id
    row = pad_vl_batch(batch, n + 8, 8, graphed.config.pad_token_id, placeholder)
    assert not row.is_vl[0, n:].any() and row.labels[0, n:].eq(-100).all() and row.grids == ((1, 4, 4),)
    assert row.input_ids[0, row.image_positions].eq(placeholder).all() and row.image_positions.numel() == 4
    assert not graphed.real_tokens([row])[n:].any() and graphed.real_tokens([row])[:n].all()
    with torch.no_grad():
        text, vl = graphed._masked_loss_sums(row)
        ref_text, ref_vl = graphed._loss_sums(batch)
    torch.testing.assert_close(torch.stack([text, vl]), torch.stack([ref_text, ref_vl]), rtol=1e-5, atol=1e-5)
    # the masked loss's forward and backward (tower, splice, text model) read nothing back; the CPU
    # chunked KDA reads its lengths (CUDA runs fla's kernels), and the CPU optimizer its lr
    monkeypatch.setattr(KimiDeltaAttention, "op", allow_host_reads(KimiDeltaAttention.op))
    with host_free(), no_host_reads():
        text, vl = graphed._masked_loss_sums(row)
        (text + vl).backward()


def test_tower_with_host_grids_and_a_cached_layout_reads_nothing_back():
    cfg = VisionConfig(vt_hidden_size=32, vt_num_hidden_layers=1, vt_num_attention_heads=2, qkv_hidden_size=32,
                       vt_intermediate_size=64, mm_hidden_size=32, text_hidden_size=32, init_pos_emb_height=8,
                       init_pos_emb_width=8)
    tower = MoonViT(cfg)
    grids = ((1, 4, 4), (2, 2, 6))
    pixels = torch.randn(16 + 24, 3, 14, 14)
    ref = tower(pixels, torch.tensor(grids))  # a tensor: read once, the layout cached for the grid tuple
    layout = tower.layouts.get(grids, pixels.device)
    assert layout.bounds == (0, 16, 40) and layout.max_seqlen == 24 and layout.cu_seqlens.dtype == torch.int32
    with host_free(), no_host_reads():  # a CPU tensor's .tolist() would count: grids come as host ints
        out = tower(pixels, grids)
        out.sum().backward()
    assert torch.equal(out, ref) and tower.layouts.get(grids, pixels.device) is layout
    assert tower.patch_embed.proj.weight.grad is not None
