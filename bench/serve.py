"""Throughput and time-to-first-token of the k3 engine vs HF transformers `generate`, on the same
random Kimi-Linear-config weights (written by transformers, loaded by k3).

    python -m bench.serve [--size tiny|gpu] [--device cpu|cuda] [--prompts 16 --prompt-len 64
                          --new-tokens 32] [--mixed N] [--modes graphs,eager]

Both run greedy with the same batch, in the same dtype (fp32 on CPU, bf16 on CUDA), after one
untimed warm-up run of the same work (kernel compilation and autotuning are not measured); HF's
batch is uniform-length (no padding needed). TTFT for HF is its batched prefill + first token
(`max_new_tokens=1`); for k3 it is the mean over requests of arrival -> first token under
continuous batching. On CUDA both use fla's KDA kernels (transformers picks them up when
flash-linear-attention is installed), and the k3 engine runs three ways: replaying decode batches from
CUDA graphs (its default), the same with each layer's norms, mixer, FFN and AttnRes reads compiled
(`k3 serve --compile`), and eagerly.

Correctness alongside: the prefill logits of HF and of k3 in the bench dtype, each against HF's
fp32 forward on the same device (the reference implementation). Prints a short table last.
`--mixed N` then runs N requests of mixed lengths, HF in static batches against continuous batching.
"""
from __future__ import annotations

import argparse
import copy
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Iterator

import torch
import transformers

from bench.common import rel_err
from bench.serve_modes import K3_MODES, agreement_summary, mixed_line, steps_line
from k3.checkpoint.pretrained import load_pretrained
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams

# Kimi-Linear configs: "tiny" is about k3-tiny (8 layers, MLA at 4 and 8); "gpu" is k3-1b-like
# (12 layers of width 1024, 8 KDA heads of 128, MLA at 4, 8, 12 with the official 512/64 latent
# and 128/128 heads, 32 experts of which 4 are picked, plus a shared one).
SIZES = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "intermediate_size": 384,
                 "moe_intermediate_size": 96, "num_experts": 16, "num_experts_per_token": 2, "kv_lora_rank": 32,
                 "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "kda_head_dim": 32, "kda_heads": 4,
                 "mla_layers": [4, 8]},
    "gpu": {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8, "intermediate_size": 2816,
                "moe_intermediate_size": 512, "num_experts": 32, "num_experts_per_token": 4, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kda_head_dim": 128, "kda_heads": 8,
                "mla_layers": [4, 8, 12]},
}


def kimi_linear(vocab: int, size: str = "tiny") -> transformers.KimiLinearForCausalLM:
    """A random Kimi-Linear-config model of one of SIZES."""
    c = dict(SIZES[size])
    layers, mla, heads, head_dim = c.pop("num_hidden_layers"), c.pop("mla_layers"), c.pop("kda_heads"), c.pop("kda_head_dim")
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=c["num_attention_heads"],
        num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, mla_use_nope=True,
        linear_attn_config={"kda_layers": [i for i in range(1, layers + 1) if i not in mla], "full_attn_layers": mla,
                            "head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **c)
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # random weights with some spread, so greedy outputs are not degenerate
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05 if size == "tiny" else 0.02)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def bench_hf(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    _sync(prompts.device)
    t = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
    _sync(prompts.device)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    _sync(prompts.device)
    elapsed = time.perf_counter() - t
    return ttft, elapsed, out[:, prompts.shape[1]:].tolist()


def bench_k3(model, prompts: list[list[int]], new_tokens: list[int], budget: int, max_num_seqs: int,
             cuda_graphs: bool = True, compile: str | None = None,
             packed_graphs: bool = False) -> tuple[float, float, list[list[int]], dict]:
    """All requests submitted at once; the engine runs at most `max_num_seqs` of them at a time
    (continuous batching) and its cache holds that many requests' pages. Returns the mean TTFT, the
    elapsed time, each request's tokens, and per kind of forward (k3.serve.runner.STEP_KINDS) how
    many ran and the seconds their steps took (each step synchronized: sampling reads the chosen
    tokens back to the host every step anyway)."""
    longest = max(len(p) + n for p, n in zip(prompts, new_tokens))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                           max_model_len=max(longest, 4096), enable_prefix_caching=False,
                                           cache_bytes=_engine_cache_bytes(model, max_num_seqs, longest),
                                           cuda_graphs=cuda_graphs, compile=compile, packed_graphs=packed_graphs))
    device = next(model.parameters()).device
    counts = engine.runner.step_counts
    seconds: Counter[str] = Counter()
    slowest: dict[str, float] = {}
    shape = _record_step_shapes(engine)
    _sync(device)
    t0 = time.perf_counter()
    requests = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, new_tokens)]
    first: dict[str, float] = {}
    while engine.has_unfinished:
        before, t = counts.copy(), time.perf_counter()
        outputs = engine.step()
        _sync(device)
        for kind in counts - before:  # one forward per step
            took = time.perf_counter() - t
            seconds[kind] += took
            slowest[kind] = max(slowest.get(kind, 0.0), took)
            if took == slowest[kind]:
                shape[kind] = dict(shape["last"])
        for o in outputs:
            first.setdefault(o.request_id, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    steps = {kind: {"count": counts[kind], "seconds": seconds[kind], "slowest_s": slowest[kind], **shape[kind]}
             for kind in counts}
    return sum(first.values()) / len(first), elapsed, [r.output_token_ids for r in requests], steps


def _record_step_shapes(engine: LLMEngine) -> dict[str, dict]:
    """shape["last"]: the tokens and requests of the runner's latest step (wraps its execute)."""
    shape: dict[str, dict] = {"last": {}}
    execute = engine.runner.execute

    def recorded(out, params):
        shape["last"] = {"tokens": sum(len(r.token_ids) for r in out.requests), "requests": len(out.requests)}
        return execute(out, params)
    engine.runner.execute = recorded
    return shape


@torch.inference_mode()
def bench_hf_batches(model, prompts: list[list[int]], new_tokens: list[int],
                     batch: int) -> tuple[float, list[list[int]], int]:
    """HF `generate` as a static-batching server runs it: requests in arrival order, `batch` at a
    time, left-padded to the batch's longest prompt (with the attention mask, which Kimi-Linear's
    KDA layers honour by zeroing padded inputs), each batch decoding for its longest request.
    Returns the elapsed time, each request's tokens and the number of rows decoded."""
    device = next(model.parameters()).device
    kw = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    outputs, rows = [], 0
    _sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, wants = prompts[i:i + batch], new_tokens[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(wants), min_new_tokens=max(wants), **kw)
        outputs += [row[width:width + n] for row, n in zip(out.tolist(), wants)]
        rows += len(chunk) * max(wants)
    _sync(device)
    return time.perf_counter() - t0, outputs, rows


def mixed_workload(requests: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int], vocab: int,
                   seed: int = 1) -> tuple[list[list[int]], list[int]]:
    """Requests with prompt and output lengths drawn uniformly from the inclusive ranges (seeded)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_lens[0], prompt_lens[1] + 1, (requests,), generator=g).tolist()
    wants = torch.randint(new_tokens[0], new_tokens[1] + 1, (requests,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths], wants


def _engine_cache_bytes(model, num_seqs: int, tokens: int) -> int:
    """Pages for every sequence's latents and KDA states, twice over (headroom), at least 64 MiB."""
    from k3.serve.page_layout import PageLayout

    dtype = next(model.parameters()).dtype
    layout = PageLayout.from_config(model.config, EngineConfig.block_size, dtype)
    per_seq = (layout.mla_pages_for(tokens) + layout.pages_per_snapshot * layout.num_kda_layers) * layout.page_bytes
    return max(64 << 20, 2 * num_seqs * per_seq)


def run(size: str, device: torch.device, prompts: int, prompt_len: int, new_tokens: int, vocab: int,
        warmup: bool = True, mixed: dict | None = None, modes: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """Both engines on the same prompts; returns throughput, TTFT, greedy agreement and each
    implementation's prefill logits error against HF fp32 on the device, as ("uniform", result);
    then, with `mixed` (the keyword arguments of `mixed_workload` plus `concurrency` and `budget`),
    ("mixed", result). Yielded as each is done, so a caller out of time keeps the first. `modes`: the
    engine configurations to run (K3_MODES keys; default all that the device runs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = kimi_linear(vocab, size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (prompts, prompt_len), generator=g)
    probe = ids[:4]
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d, device=device, dtype=dtype).eval()
    # HF in fp32 on the device as the reference (with fla installed transformers sends even CPU
    # tensors to its Triton kernels, so CPU is not an option there; fla rounds fp32 operands to
    # tf32, ~1e-3, far below what would mean two implementations disagree)
    hf = hf.to(device)
    with torch.inference_mode():
        reference = hf(probe.to(device)).logits.float().cpu()
    hf = hf.to(dtype)
    hf_rel, hf_first = logits_error(reference, hf, probe.to(device), lambda out: out.logits)
    k3_rel, k3_first = logits_error(reference, ours, probe.to(device), lambda out: out)
    budget = prompts * prompt_len
    # the compiled mode runs on its own copy (EngineConfig.compile compiles the model in place); its
    # compilation happens in the warm-up round, and the measured round's engine reuses it
    modes = {m: K3_MODES[m] for m in modes or K3_MODES if device.type == "cuda" or not K3_MODES[m][1]}
    if not modes:
        raise ValueError(f"no engine mode of {list(K3_MODES)} runs on {device}")
    models = {mode: copy.deepcopy(ours) if compile else ours for mode, (_, _, compile) in modes.items()}
    for _ in range(1 + warmup):  # the last round is the measured one
        hf_ttft, hf_time, hf_out = bench_hf(hf, ids.to(device), new_tokens)
        k3 = {mode: bench_k3(models[mode], ids.tolist(), [new_tokens] * prompts, budget, prompts, graphs, compile)
              for mode, (_, graphs, compile) in modes.items()}
    n = prompts * new_tokens
    result = {"hf_tokens_per_s": n / hf_time, "hf_ttft_s": hf_ttft, "dtype": str(dtype).removeprefix("torch."),
              "hf_prefill_rel_err": hf_rel, "hf_first_token_agreement": hf_first,
              "k3_prefill_rel_err": k3_rel, "k3_first_token_agreement": k3_first}
    for mode, (ttft, elapsed, out, steps) in k3.items():
        result[f"k3_{mode}_steps"] = steps
        result[f"k3_{mode}_tokens_per_s"] = n / elapsed
        result[f"k3_{mode}_ttft_s"] = ttft
        result[f"k3_{mode}_throughput_ratio"] = hf_time / elapsed
        result[f"k3_{mode}_agreement_with_hf"] = agreement(hf_out, out)
    for mode in k3.keys() - {"eager"} if "eager" in k3 else ():
        result[f"{mode}_agreement_with_eager"] = agreement(k3["eager"][2], k3[mode][2])
    yield "uniform", result
    if mixed is not None:
        yield "mixed", run_mixed(hf, ours, {k: v for k, v in mixed.items() if k != "profile"}, vocab, warmup,
                                 mixed.get("profile", False))


def run_mixed(hf, ours, workload: dict, vocab: int, warmup: bool = True, profile: bool = False) -> dict:
    """The mixed workload: HF in static batches of `concurrency`, the k3 engine (its default mode on
    the device) with at most that many requests running; with `warmup`, each runs it once untimed
    first (its shapes are new: kernels specialize and autotune on them). Throughput counts only the
    tokens each request asked for. `profile`: then the engine once more under torch.profiler, and
    its tables (where host and device time go)."""
    prompts, wants = mixed_workload(workload["requests"], workload["prompt_lens"], workload["new_tokens"], vocab)
    concurrency, budget = workload["concurrency"], workload["budget"]
    mode = "graphs" if next(ours.parameters()).is_cuda else "eager"
    _, graphs, _ = K3_MODES[mode]
    for label in ("warm-up", "measured")[not warmup:]:
        hf_time, hf_out, hf_rows = bench_hf_batches(hf, prompts, wants, concurrency)
        print(f"mixed workload, {label}: HF static batches took {hf_time:.1f} s", flush=True)
        ttft, k3_time, k3_out, steps = bench_k3(ours, prompts, wants, budget, concurrency, graphs,
                                                packed_graphs=graphs)
        print(f"mixed workload, {label}: k3 engine ({mode}) took {k3_time:.1f} s; {steps_line(steps)}", flush=True)
    plain = None
    if graphs:  # the same workload with packed steps run plainly (the default): what static buckets gain
        plain_time = bench_k3(ours, prompts, wants, budget, concurrency, graphs, packed_graphs=False)[1]
        print(f"mixed workload: k3 engine with plain packed steps took {plain_time:.1f} s", flush=True)
        plain = {f"k3_{mode}_plain_packed_throughput_ratio": hf_time / plain_time}
    if profile:
        profile_engine(ours, prompts, wants, budget, concurrency, graphs)
    n = sum(wants)
    return {**workload, "mode": mode, "output_tokens": n, "hf_tokens_per_s": n / hf_time,
            "hf_useful_fraction": n / hf_rows,
            f"k3_{mode}_tokens_per_s": n / k3_time, f"k3_{mode}_ttft_s": ttft,
            f"k3_{mode}_throughput_ratio": hf_time / k3_time, f"k3_{mode}_agreement_with_hf": agreement(hf_out, k3_out),
            f"k3_{mode}_steps": steps, **(plain or {})}


def profile_engine(model, prompts: list[list[int]], new_tokens: list[int], budget: int, max_num_seqs: int,
                   cuda_graphs: bool) -> None:
    """One more engine run under torch.profiler: the host ops that take the most time, then (on
    CUDA) the kernels and the aten ops whose kernels take the most."""
    from bench.kernel_profile import print_kernel_tables, print_op_table
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = next(model.parameters()).is_cuda
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        _, _, _, steps = bench_k3(model, prompts, new_tokens, budget, max_num_seqs, cuda_graphs)
    forwards = sum(s["count"] for s in steps.values())
    print(f"\n### profiled engine run: {steps_line(steps)}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    if cuda:
        print_kernel_tables(prof, forwards, "engine forwards, per forward")
        print_op_table(prof, forwards)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions with the same greedy token."""
    return sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / sum(len(p) for p in a)


@torch.inference_mode()
def logits_error(reference: torch.Tensor, model, ids: torch.Tensor, logits_of) -> tuple[float, float]:
    """RMSE(reference - logits) / RMSE(reference) of a prefill, and how often its greedy first token
    agrees. With random weights the logits are nearly flat, so a rounding-level difference can flip
    a near-tie: the error, not the agreement, tells whether two implementations agree."""
    out = logits_of(model(ids)).float().cpu()
    return rel_err(reference, out), (reference[:, -1].argmax(-1) == out[:, -1].argmax(-1)).float().mean().item()


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or set(modes) - K3_MODES.keys():
        raise argparse.ArgumentTypeError(f"want a comma list of {', '.join(K3_MODES)}, got {text!r}")
    return modes


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-warmup", action="store_true", help="measure the first run (includes compilation)")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="also run N requests of mixed lengths, at most --prompts at a time (HF: static batches)")
    ap.add_argument("--mixed-prompt-lens", type=_range, default=(32, 512), metavar="LO,HI")
    ap.add_argument("--mixed-new-tokens", type=_range, default=(8, 128), metavar="LO,HI")
    ap.add_argument("--modes", type=_modes, default=None,
                    help=f"engine configurations to run, comma-separated, of {','.join(K3_MODES)} (default: all "
                    "that the device runs; the mixed workload uses graphs on CUDA, eager elsewhere)")
    ap.add_argument("--profile", action="store_true",
                    help="after the mixed workload, run its engine once more under torch.profiler and print where time goes")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    mixed = None if not args.mixed else {
        "requests": args.mixed, "prompt_lens": args.mixed_prompt_lens, "new_tokens": args.mixed_new_tokens,
        "concurrency": args.prompts, "budget": args.prompts * args.prompt_len, "profile": args.profile}
    results = dict(run(args.size, device, args.prompts, args.prompt_len, args.new_tokens, args.vocab,
                       not args.no_warmup, mixed, args.modes))
    r = results["uniform"]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    table = ["| engine | tokens/s | TTFT (s) | vs HF | greedy agreement with HF |", "|---|---|---|---|---|",
             f"| HF transformers generate | {r['hf_tokens_per_s']:.1f} | {r['hf_ttft_s']:.3f} | 1.00x | |"]
    for mode, (label, _, _) in K3_MODES.items():
        if f"k3_{mode}_tokens_per_s" in r:
            table.append(f"| k3 engine ({label}) | "
                         f"{r[f'k3_{mode}_tokens_per_s']:.1f} | {r[f'k3_{mode}_ttft_s']:.3f} | "
                         f"{r[f'k3_{mode}_throughput_ratio']:.2f}x | {r[f'k3_{mode}_agreement_with_hf']:.1%} |")
    summary = (f"prefill logits vs HF fp32: HF {r['dtype']} {r['hf_prefill_rel_err']:.2e}, "
               f"k3 {r['dtype']} {r['k3_prefill_rel_err']:.2e}")
    summary += agreement_summary(r)
    if "mixed" in results:
        summary += "\n" + mixed_line(results["mixed"])
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.new_tokens} new tokens, {where}, "
          f"{r['dtype']}, Kimi-Linear config '{args.size}', torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(summary)
    print("\n".join(table))


if __name__ == "__main__":
    main()
