"""A sizing plan on paper: memory, communication and a step-time bound for DP x EP x CP x PP layouts.

N GPUs = DP * EP * CP * PP. DP*EP ranks read different sequences (EP is carved out of the data
dimension, as in torchtitan), CP splits each sequence along time, PP splits the layers. T the
sequence length, t = T / CP the tokens a GPU holds per micro-batch, k experts per token.

Assumptions (docs/SCALING.md lists them with the reasoning):
- weights: fp32 master parameters and fp32 gradients, FSDP/ZeRO-3 sharded; dense (non-routed)
  parameters over the DP*EP*CP ranks of a stage, routed experts over EP (placement) and then DP*CP;
  optimizer state: Per-Head Muon keeps one fp32 momentum per matrix, AdamW two fp32 moments for
  embeddings, lm_head, norms and the other small tensors (k3/train/muon.py param_groups);
  transient: two layers' bf16 weights gathered (one computing, one prefetched).
- activations: what autograd saves for one micro-batch, measured by running this model's own code
  on the meta device (no memory, no FLOPs) with saved-tensor hooks, in the training dtype; fp32 on
  CPU, bf16 weights on GPU (norms, router, KDA state stay fp32 as in the model). Measured at
  min(t, 4096) tokens and scaled linearly beyond (chunked KDA, MoE and flash attention are linear
  in t). No activation checkpointing. 1F1B pipelining keeps min(PP, micro-batches) in flight.
- communication per GPU per step (bytes sent): EP all-to-all of bf16 latents, dispatch + combine,
  forward and backward, (EP-1)/EP of the pairs leave the rank; FSDP all-gather (bf16, forward and
  backward) and reduce-scatter (fp32) once per micro-batch; KCP one all-gather of the [H, K, K+V]
  fp32 state pairs per KDA layer, MLA one all-gather of the latents, forward and backward; PP one
  [t, D] bf16 activation per stage boundary each way.
- time: compute = tokens x the training FLOP model per token (k3/flops.py: 6 * active parameters,
  causal MLA attention over the whole sequence, the KDA recurrence; 8/6 of it with activation
  checkpointing), at the GPU's dense bf16 peak x MFU; communication at NVLink bandwidth
  inside a node and the per-GPU network bandwidth across nodes (EP, CP groups are innermost);
  bound = max(compute, communication) (full overlap), and their sum (none) as the pessimistic side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from k3.config import K3Config
from k3.flops import train_flops_per_token
from k3.model.params import count_parameters

GiB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # usable HBM
    bf16_tflops: float  # dense peak
    nvlink_gbps: float  # GB/s one direction per GPU
    network_gbps: float  # GB/s one direction per GPU across nodes
    per_node: int = 8


# vendor datasheet figures (dense bf16, no sparsity; NVLink per direction; one 400G NIC per GPU)
GPUS = {
    "h100": GPU("h100", 79.6, 989.0, 450.0, 50.0),
    "h200": GPU("h200", 139.8, 989.0, 450.0, 50.0),
    "b200": GPU("b200", 178.0, 2250.0, 900.0, 50.0),
    "cpu": GPU("cpu", float("inf"), 1.0, 10.0, 10.0, per_node=1),
}


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.ep * self.cp * self.pp

    def __str__(self) -> str:
        return f"DP{self.dp} EP{self.ep} CP{self.cp} PP{self.pp}"


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    global_tokens: int = 16 * 1024 * 1024  # tokens per optimizer step
    mfu: float = 0.4
    training_dtype: str = "bf16"  # "bf16" (GPU: bf16 weights in compute, fp32 master) | "fp32"
    checkpointing: bool = True  # full activation checkpointing per layer


@dataclass
class Sizing:
    layout: Layout
    micro_batches: int
    memory: dict  # GiB per GPU: weights, grads, optimizer, gathered, activations, total
    comm: dict  # GB sent per GPU per step: ep_a2a, fsdp, cp, pp
    time: dict  # seconds: compute, comm, bound, no_overlap
    fits: bool


def optimizer_rule(name: str, p: torch.Tensor) -> str:
    """Which rule updates a parameter, as k3/train/muon.py param_groups sorts them (the sizing test
    checks the two agree; k3.train is not imported here, it imports this package): Muon for weight
    matrices and stacked expert weights, AdamW for the embedding, lm_head, the depthwise convs, the
    AttnRes pseudo-queries and every vector."""
    if name.startswith(("model.embed_tokens", "lm_head")) or name.endswith(("conv1d.weight", "_res_proj.weight")):
        return "adamw"
    return "muon" if p.dim() >= 2 else "adamw"


def _split_params(config: K3Config) -> dict:
    """Parameter counts by where they live and which rule updates them (a meta-device model):
    routed experts, the embedding and lm_head (one PP stage each), the other dense tensors."""
    from k3.model.transformer import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    out = {"routed_muon": 0, "routed_adamw": 0, "dense_muon": 0, "dense_adamw": 0, "head_muon": 0, "head_adamw": 0}
    for name, p in model.named_parameters():
        where = ("routed" if ".block_sparse_moe.experts." in name else
                 "head" if name.startswith(("model.embed_tokens", "lm_head")) else "dense")
        out[f"{where}_{optimizer_rule(name, p)}"] += p.numel()
    out["active"] = count_parameters(config)["active"]
    return out


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Sums the distinct storages autograd saves for backward, parameters excluded."""

    def __init__(self, exclude: set[int]):
        self.seen: set[int] = set(exclude)
        self.bytes = 0

        def pack(t: torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def _balanced_loop(experts, x, counts, w1, w3, w2):
    """The expert loop with the pairs spread evenly (a balanced plan, DESIGN §14.2): on the meta
    device split sizes cannot be read, and one matmul over all rows saves what E matmuls save."""
    return F.linear(experts.act(F.linear(x, w1[0]), F.linear(x, w3[0])), w2[0])


def _layer_signature(config: K3Config, i: int) -> tuple:
    bs = config.attn_res_block_size
    return (config.is_mla_layer(i), config.is_moe_layer(i), bs is not None and i % bs == 0, i == 0)


def _blocks_before(config: K3Config, i: int) -> int:
    """Finished AttnRes blocks when layer i starts (layer 0 opens the first, the embedding's)."""
    bs = config.attn_res_block_size
    return 0 if bs is None or i == 0 else (i - 1) // bs + 1


def _fake(module: torch.nn.Module, mode) -> torch.nn.Module:
    with mode:
        return module.to_empty(device="cpu")


def measure_activations(config: K3Config, tokens: int, *, dtype: torch.dtype = torch.float32) -> dict:
    """Bytes autograd saves for one micro-batch of `tokens` (one sequence), parameters excluded:
    {"layers": all decoder layers, "max_layer": the largest one, "head": final read, norm, lm_head
    and loss plus the finished AttnRes blocks, "total"}. Runs this model's own code on fake CPU tensors (no memory, no FLOPs; the
    meta device has no autocast, which the router's fp32 guard needs). One layer of each kind
    (mixer, FFN, whether it opens an AttnRes block) is run: the others of its kind save the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3.model.attnres import BlockSource, attn_res_read, new_attn_res_pair
    from k3.model.experts import RoutedExperts
    from k3.model.norm import RMSNorm
    from k3.model.transformer import K3DecoderLayer

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    D, V, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
    attnres = config.attn_res_block_size is not None

    def run(modules, n_blocks: int, fn) -> int:
        with mode:
            h = torch.zeros(1, tokens, D, dtype=dtype, requires_grad=True)
            blocks = [BlockSource(torch.zeros(1, tokens, D), eps) for _ in range(n_blocks)]
        exclude = {t.untyped_storage()._cdata for m in modules for t in (*m.parameters(), *m.buffers())}
        exclude |= {t.untyped_storage()._cdata for b in blocks for t in (b.value, b.rstd)}
        hooks = _SavedBytes(exclude)
        with mode, hooks:
            fn(h, blocks if attnres else None)
        return hooks.bytes

    per_kind: dict[tuple, int] = {}
    total = 0
    for i in range(config.num_hidden_layers):
        sig = _layer_signature(config, i)
        if sig not in per_kind:
            with torch.device("meta"):
                layer = K3DecoderLayer(config, i).to(dtype)  # keeps the fp32 tensors fp32 (k3/model/precision.py)
            for m in layer.modules():
                if isinstance(m, RoutedExperts):
                    m._loop_over_experts = lambda x, counts, w1, w3, w2, _m=m: _balanced_loop(_m, x, counts, w1, w3, w2)
            layer = _fake(layer, mode)
            per_kind[sig] = run([layer], _blocks_before(config, i), layer)
        total += per_kind[sig]
    # the head: the final AttnRes read, norm, lm_head, loss
    with torch.device("meta"):
        norm, lm_head = RMSNorm(D, eps).to(dtype), torch.nn.Linear(D, V, bias=False).to(dtype)
        proj, rnorm = new_attn_res_pair(D, eps)
    norm, lm_head, proj, rnorm = (_fake(m, mode) for m in (norm, lm_head, proj, rnorm))
    n_final = _blocks_before(config, config.num_hidden_layers)

    def head(h, blocks):
        x = attn_res_read(h, blocks, proj, rnorm) if blocks is not None else h
        logits = lm_head(norm(x)).float()
        F.cross_entropy(logits[0], torch.zeros(tokens, dtype=torch.long), reduction="sum")

    # the finished blocks' fp32 values and rstds live until backward; each counted once here
    head_bytes = run([norm, lm_head, proj, rnorm], n_final, head) + (n_final if attnres else 0) * tokens * (D + 1) * 4
    return {"layers": total, "max_layer": max(per_kind.values()), "head": head_bytes, "total": total + head_bytes}


_MEASURED: dict = {}


def activation_bytes(config: K3Config, tokens: int, dtype: torch.dtype) -> dict:
    """measure_activations at `tokens`: measured directly up to 4 KDA chunks, beyond that each
    part fitted as a + b*tokens at 2 and 4 chunks (every part is linear in the tokens: chunked KDA,
    the MoE, fused attention; the per-sequence KDA state is the constant)."""
    def measured(t: int) -> dict:
        key = (repr(config), t, dtype)
        if key not in _MEASURED:
            _MEASURED[key] = measure_activations(config, t, dtype=dtype)
        return _MEASURED[key]

    t1, t2 = 2 * config.kda_chunk_size, 4 * config.kda_chunk_size
    if tokens <= t2:
        return measured(tokens)
    b1, b2 = measured(t1), measured(t2)
    return {k: int(b1[k] + (b2[k] - b1[k]) / (t2 - t1) * (tokens - t1)) for k in b1}


def size_layout(config: K3Config, layout: Layout, gpu: GPU, work: Workload, params: dict | None = None) -> Sizing:
    """Memory per GPU (the busiest pipeline stage), bytes sent per GPU per step and the time bound."""
    params = params or _split_params(config)
    L, pp = config.num_hidden_layers, layout.pp
    stage = math.ceil(L / pp) / L  # the largest stage's share of the layers
    data_ranks = layout.dp * layout.ep
    seqs = max(1, work.global_tokens // work.seq_len)
    micro = max(1, math.ceil(seqs / data_ranks))  # micro-batches per step (one sequence each)
    t = work.seq_len // layout.cp
    shard = layout.dp * layout.ep * layout.cp  # FSDP group of the dense weights in a stage
    expert_group = layout.dp * layout.cp  # FSDP group of one EP rank's experts
    # the embedding sits on the first stage, lm_head on the last: with PP the busier stage holds one of them
    head = 0.5 if pp > 1 else 1.0
    dense_stage = (params["dense_muon"] + params["dense_adamw"]) * stage + \
        (params["head_muon"] + params["head_adamw"]) * head  # on every rank of the stage
    routed_stage = (params["routed_muon"] + params["routed_adamw"]) * stage / layout.ep  # this EP rank's experts
    # dense tensors shard over the stage's DP*EP*CP ranks, an EP rank's experts over its DP*CP peers
    muon = (params["dense_muon"] * stage + params["head_muon"] * head) / shard + \
        params["routed_muon"] * stage / layout.ep / expert_group
    adamw = (params["dense_adamw"] * stage + params["head_adamw"] * head) / shard + \
        params["routed_adamw"] * stage / layout.ep / expert_group
    local = muon + adamw
    wbytes = 2 if work.training_dtype == "bf16" else 4
    # the step's working copy: the stage's weights (this EP rank's experts) gathered once per step in
    # the compute dtype, and gradients accumulated beside them, reduce-scattered once per step
    gathered = 2 * wbytes * (dense_stage + routed_stage) if shard > 1 else 0.0
    dtype = torch.bfloat16 if work.training_dtype == "bf16" else torch.float32
    act = activation_bytes(config, t, dtype)
    if work.checkpointing:  # each layer keeps its input; one layer is recomputed at a time
        per_mb = (config.num_hidden_layers * stage * t * config.hidden_size * wbytes
                  + act["max_layer"] + act["head"])
    else:
        per_mb = act["layers"] * stage + act["head"]
    activations = per_mb * (min(pp, micro) if pp > 1 else 1)  # 1F1B: up to PP micro-batches in flight
    memory = {"weights": 4 * local / GiB, "grads": 4 * local / GiB, "optimizer": (4 * muon + 8 * adamw) / GiB,
              "gathered": gathered / GiB, "activations": activations / GiB}
    memory["total"] = sum(memory.values())

    # communication, bytes sent per GPU per step
    H_lat, k = config.moe_hidden_size, config.num_experts_per_token
    moe_layers = sum(config.is_moe_layer(i) for i in range(L))
    a2a = micro * t * k * H_lat * 2 * 4 * moe_layers * stage * (layout.ep - 1) / layout.ep
    # once per step: all-gather of the working copy, reduce-scatter of the accumulated gradients
    fsdp = 2 * wbytes * (dense_stage * (shard - 1) / shard + routed_stage * (expert_group - 1) / expert_group)
    kda_layers = config.num_kda_layers * stage
    mla_layers = (L - config.num_kda_layers) * stage
    K, H = config.kda_head_dim, config.kda_num_heads
    cp_bytes = 0.0
    if layout.cp > 1:  # forward and backward: the KCP state pairs, the MLA latents
        state = H * K * (K + K) * 4
        latents = t * config.mla_cache_width * wbytes
        cp_bytes = micro * 2 * (kda_layers * state + mla_layers * latents) * (layout.cp - 1)
    pp_bytes = micro * 2 * t * config.hidden_size * wbytes if pp > 1 else 0.0
    comm = {"ep_a2a": a2a / 1e9, "fsdp": fsdp / 1e9, "cp": cp_bytes / 1e9, "pp": pp_bytes / 1e9}

    # time: the training FLOP model per token (k3/flops.py: 6 N_active, causal MLA attention over the
    # whole sequence, CP ranks splitting the queries, and the KDA recurrence), for the stage's layers
    per_token = train_flops_per_token(config, work.seq_len, params["active"])["total"]
    passes = 8 if work.checkpointing else 6  # recomputing the forward adds a third pass: 8 / 6 of fwd + bwd
    flops = micro * t * stage * per_token * passes / 6
    bubble = (pp - 1) / (micro + pp - 1) if pp > 1 else 0.0
    compute = flops / (gpu.bf16_tflops * 1e12 * work.mfu) / (1 - bubble)
    inner = gpu.per_node  # EP and CP groups innermost: inside a node while they fit
    ep_bw = gpu.nvlink_gbps if layout.ep * layout.cp <= inner else gpu.network_gbps
    cp_bw = gpu.nvlink_gbps if layout.cp <= inner else gpu.network_gbps
    fsdp_bw = gpu.nvlink_gbps if shard <= inner else gpu.network_gbps
    comm_t = (a2a / ep_bw + fsdp / fsdp_bw + cp_bytes / cp_bw + pp_bytes / gpu.network_gbps) / 1e9
    time = {"compute": compute, "comm": comm_t, "bound": max(compute, comm_t), "no_overlap": compute + comm_t}
    return Sizing(layout, micro, memory, comm, time, memory["total"] <= gpu.memory_gib)


def candidate_layouts(config: K3Config, gpus: int, seq_len: int) -> list[Layout]:
    """Every DP x EP x CP x PP = gpus with EP dividing the experts, CP dividing the sequence into
    chunk multiples, PP at most the layers."""
    out = []
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    for ep in divisors:
        if config.num_experts and config.num_experts % ep:
            continue
        for cp in divisors:
            if (gpus // ep) % cp or seq_len % cp or (seq_len // cp) % config.kda_chunk_size:
                continue
            for pp in divisors:
                rest = gpus // ep // cp
                if rest % pp or pp > config.num_hidden_layers or pp not in (1, 2, 4, 8, 16, 32):
                    continue
                out.append(Layout(rest // pp, ep, cp, pp))
    return out


def plan(config: K3Config, gpus: int, gpu: GPU, work: Workload) -> list[Sizing]:
    """All candidate layouts sized; those that fit first, fastest first."""
    params = _split_params(config)
    sized = [size_layout(config, lay, gpu, work, params) for lay in candidate_layouts(config, gpus, work.seq_len)]
    # ties on the bound (compute-bound layouts) go to the one that sends less, then uses less memory
    return sorted(sized, key=lambda s: (not s.fits, round(s.time["bound"], 3), s.time["comm"], s.memory["total"]))
