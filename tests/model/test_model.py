"""Whole-model properties: decode = prefill, packing and padding,
MLA absorbed = naive, Block AttnRes at init, parameter accounting."""
from __future__ import annotations

import pytest
import torch

from k3.config import K3Config
from k3.generation.generate import generate
from k3.model.cache import K3Cache, MLAState
from k3.model.mla import GatedMLA
from k3.model.params import count_parameters
from k3.model.transformer import K3ForCausalLM
from tests.helpers import K3_CONFIG_JSON, assert_rel_close
from tests.helpers.models import randomized, small_config


@pytest.fixture(scope="module", params=[True, False], ids=["nope", "rope"])
def model(request):
    """K3's NoPE MLA, and the RoPE ablation (`mla_use_nope: false`, k3/model/mla.py), whose cached
    k_pe is rotated: every path below must hold for both."""
    torch.manual_seed(0)
    return randomized(K3ForCausalLM(small_config(mla_use_nope=request.param)))


@pytest.mark.parametrize("mla_impl", ["naive", "absorb"])
def test_token_by_token_decode_equals_one_pass(model, mla_impl):
    model.config.mla_impl = mla_impl
    ids = torch.randint(0, 256, (2, 37))
    full = model(ids)
    cache = K3Cache.empty(model.config, 2)
    prefix = model(ids[:, :20], cache=cache)
    assert_rel_close("prefill part", full[:, :20], prefix, 1e-5)
    for t in range(20, 37):
        step = model(ids[:, t:t + 1], cache=cache)
    assert_rel_close("last-position logits", full[:, -1], step[:, -1], 1e-5)
    assert cache.lengths.tolist() == [37, 37]
    model.config.mla_impl = "naive"


def test_packed_equals_separate(model):
    lens = [5, 23, 1, 40]
    seqs = [torch.randint(0, 256, (n,)) for n in lens]
    cu = torch.tensor([0] + lens).cumsum(0)
    packed = model(torch.cat(seqs)[None], cu_seqlens=cu)[0]
    for i, s in enumerate(seqs):
        assert_rel_close(f"doc {i}", model(s[None])[0], packed[cu[i]:cu[i + 1]], 1e-5)


def test_logits_to_keep_selects_rows(model):
    """Packed rows continuing a cache, logits at each document's last token only (what a serving
    step samples from): the same rows as the full logits, and the cache advanced the same."""
    lens = [5, 1, 12]
    ids = torch.randint(0, 256, (1, sum(lens)))
    cu = torch.tensor([0] + lens).cumsum(0)
    last = cu[1:] - 1
    caches = [K3Cache.empty(model.config, len(lens)) for _ in range(2)]
    full = model(ids, cu_seqlens=cu, cache=caches[0])
    kept = model(ids, cu_seqlens=cu, cache=caches[1], logits_to_keep=last)
    assert kept.shape == (1, len(lens), model.config.vocab_size)
    assert_rel_close("kept rows", full[:, last], kept, 1e-6)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == lens
    with pytest.raises(ValueError, match="padded"):
        model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=last)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_separate(model, side):
    lens = [7, 19, 12]
    seqs = [torch.randint(3, 256, (n,)) for n in lens]
    T = max(lens)
    ids = torch.full((3, T), 2)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    out = model(ids, attention_mask=mask)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        assert_rel_close(f"row {i}", model(s[None])[0], out[i, sl], 1e-5)


def test_generate_batch_equals_single(model):
    prompts = [[5, 6, 7], list(range(10, 40)), [99]]
    batch = generate(model, prompts, 8)
    for p, out in zip(prompts, batch):
        assert generate(model, [p], 8)[0] == out


def test_mla_absorbed_equals_naive_with_cache():
    cfg = small_config()
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(1, 13, cfg.hidden_size)
    outs = {}
    for impl in ("naive", "absorb"):
        cfg.mla_impl = impl
        full = layer(x)
        state = MLAState.empty(cfg, 1, capacity=16)  # more rows than used: the mask must hide the rest
        parts = torch.cat([layer(x[:, :6], state=state), layer(x[:, 6:], state=state)], dim=1)
        assert_rel_close(f"{impl}: split = full", full, parts, 1e-5)
        assert state.rows(0).shape == (13, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        outs[impl] = full
    assert_rel_close("absorbed = naive", outs["naive"], outs["absorb"], 1e-5)


def test_mla_auto_absorbs_decode_and_expands_prefill(monkeypatch):
    """mla_impl "auto" (the default): one-token queries (decode, and a packed step's decode rows)
    attend absorbed over the latents; longer ones expand them (naive)."""
    cfg = small_config()
    assert cfg.mla_impl == "auto"
    layer = GatedMLA(cfg, 3)
    calls = []
    for form in ("naive", "absorbed"):
        real = getattr(layer, f"_attend_{form}")
        monkeypatch.setattr(layer, f"_attend_{form}", lambda q, lat, mask, real=real, form=form:
                            calls.append((form, q.shape[1])) or real(q, lat, mask))
    state = MLAState.empty(cfg, 2, capacity=16)
    layer(torch.randn(2, 5, cfg.hidden_size), state=state)  # prefill
    layer(torch.randn(2, 1, cfg.hidden_size), state=state)  # decode
    layer(torch.randn(1, 4, cfg.hidden_size), cu_seqlens=torch.tensor([0, 1, 4]), state=state)  # packed
    assert calls == [("naive", 5), ("absorbed", 1), ("absorbed", 1), ("naive", 3)]


@pytest.mark.parametrize("use_nope", [True, False], ids=["nope", "rope"])
@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_mla_packed_step_with_decode_rows_equals_each_alone(impl, use_nope):
    """A serving step's packed row: one-token documents (batched together) beside longer ones and an
    empty one, each continuing its own cached past of a different length. Outputs and the cached
    latents equal each document continued alone, with and without autograd (with RoPE, each new
    token is rotated by its own position after its cached past)."""
    cfg = small_config(mla_impl=impl, mla_use_nope=use_nope)
    layer = GatedMLA(cfg, 3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    past, new = [4, 0, 9, 2, 6], [1, 5, 1, 0, 3]
    xs = [torch.randn(1, n, cfg.hidden_size) for n in past]
    steps = [torch.randn(1, n, cfg.hidden_size) for n in new]
    alone = []
    for x, step in zip(xs, steps):
        state = MLAState.empty(cfg, 1, capacity=16)
        if x.shape[1]:
            layer(x, state=state)
        alone.append((layer(step, state=state) if step.shape[1] else step.new_zeros(1, 0, cfg.hidden_size),
                      state.rows(0)))
    for grad in (False, True):
        state = MLAState.empty(cfg, len(past), capacity=16)
        cu = torch.tensor([0, *past]).cumsum(0)
        with torch.no_grad():
            layer(torch.cat(xs, dim=1), cu_seqlens=cu, state=state)
        with torch.set_grad_enabled(grad):
            out = layer(torch.cat(steps, dim=1), cu_seqlens=torch.tensor([0, *new]).cumsum(0), state=state)
        starts = torch.tensor([0, *new]).cumsum(0).tolist()
        for n, (o, rows) in enumerate(alone):
            got = out[0, starts[n]:starts[n + 1]]
            if new[n]:
                assert_rel_close(f"doc {n} outputs (grad={grad})", o[0], got, 1e-5)
            assert got.shape == o[0].shape
            assert_rel_close(f"doc {n} latents (grad={grad})", rows, state.rows(n), 1e-6)


def test_attnres_is_uniform_average_at_init(monkeypatch):
    import k3.model.transformer as tr

    reads = []
    real = tr.attn_res_read

    def spy(prefix, blocks, proj, norm):
        out = real(prefix, blocks, proj, norm)
        expected = (sum(b.value for b in blocks) + prefix.float()) / (len(blocks) + 1)
        reads.append((len(blocks) + 1, torch.allclose(out.float(), expected, atol=1e-6)))
        return out

    monkeypatch.setattr(tr, "attn_res_read", spy)
    model = K3ForCausalLM(small_config())  # fresh init: pseudo-queries are zero
    model(torch.randint(0, 256, (1, 9)))
    assert reads and all(ok for _, ok in reads)
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("_res_proj.weight"))


def test_attnres_read_is_softmax_over_normalized_keys():
    """DESIGN §5 written out in float64 with explicit keys RMSNorm_w(V_s), a random pseudo-query and
    norm weight: the read's factored score (rstd times V . (w q)) gives the same output and
    gradients for every source and the pseudo-query."""
    from k3.model.attnres import BlockSource, attn_res_read, new_attn_res_pair

    D, eps = 32, 1e-5
    proj, norm = new_attn_res_pair(D, eps)
    with torch.no_grad():
        proj.weight.normal_()
        norm.weight.uniform_(0.5, 1.5)
    sources = [(torch.randn(2, 5, D) * scale).requires_grad_() for scale in (1.0, 3.0, 0.3)]
    out = attn_res_read(sources[-1], [BlockSource(v, eps) for v in sources[:-1]], proj, norm)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, sources + [proj.weight], cotangent)

    ref_sources = [v.detach().double().requires_grad_() for v in sources]
    ref_query = proj.weight.detach().double().requires_grad_()
    keys = [v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.double() for v in ref_sources]
    alpha = torch.softmax(torch.stack([k @ ref_query[0] for k in keys]), dim=0)
    ref = sum(a.unsqueeze(-1) * v for a, v in zip(alpha, ref_sources))
    ref_grads = torch.autograd.grad(ref, ref_sources + [ref_query], cotangent.double())
    assert_rel_close("read", ref, out, 1e-6)
    for name, r, g in zip(["block 0", "block 1", "prefix", "pseudo-query"], ref_grads, grads):
        assert_rel_close(f"d {name}", r, g, 1e-5)


def test_official_layout_output_read_sees_nine_sources(monkeypatch):
    import k3.model.transformer as tr

    official = K3Config.from_json(K3_CONFIG_JSON)
    cfg = small_config(num_hidden_layers=official.num_hidden_layers, kda_layers=official.kda_layers,
                       full_attn_layers=official.full_attn_layers,
                       attn_res_block_size=official.attn_res_block_size, hidden_size=16, intermediate_size=16,
                       num_experts=4, moe_intermediate_size=8, routed_expert_hidden_size=8, q_lora_rank=8)
    sources = []
    real = tr.attn_res_read
    monkeypatch.setattr(tr, "attn_res_read", lambda p, b, proj, norm: sources.append(len(b) + 1) or real(p, b, proj, norm))
    K3ForCausalLM(cfg)(torch.randint(0, 256, (1, 3)))
    assert sources[-1] == 9  # embedding + 8 blocks (DESIGN §5)


def test_without_attn_res_block_size_is_plain_residual():
    cfg = small_config(attn_res_block_size=None)
    model = K3ForCausalLM(cfg)
    assert not any("_res_" in n for n, _ in model.named_parameters())
    ids = torch.randint(0, 256, (1, 11))
    h = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        h = h + layer.mixer(h, None, None)
        h = h + layer.ffn(h)
    ref = model.lm_head(model.model.norm(h)).float()
    assert_rel_close("plain residual", ref, model(ids), 1e-6)


def test_official_parameter_counts_match_report():
    counts = count_parameters(K3Config.from_json(K3_CONFIG_JSON))
    assert abs(counts["total"] / 2.78e12 - 1) < 0.005, counts["total"]
    assert abs(counts["active"] / 104.2e9 - 1) < 0.005, counts["active"]


def test_params_cli_json(capsys):
    import json

    from k3.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["params", "--config", str(K3_CONFIG_JSON), "--json"])
    assert exit_.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"total", "active", "components"} <= set(out)
