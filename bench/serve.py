"""Throughput and time-to-first-token of the k3 engine vs HF transformers `generate`, on the same
small random Kimi-Linear-config weights (written by transformers, loaded by k3).

    python bench/serve.py [--prompts 16 --prompt-len 64 --new-tokens 32] [--record docs/BENCHMARKS.md]

Both run greedy with the same batch; HF's batch is uniform-length (no padding needed). TTFT for HF
is its batched prefill + first token (`max_new_tokens=1`); for k3 it is the mean over requests of
arrival -> first token under continuous batching. Prints a short table last.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3.model.checkpoint import load_pretrained  # noqa: E402
from k3.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from k3.serve.sampling import SamplingParams  # noqa: E402


def kimi_linear(vocab: int) -> transformers.KimiLinearForCausalLM:
    """A Kimi-Linear-config model about the size of k3-tiny: 8 layers, MLA at 4 and 8, MoE."""
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=384, moe_intermediate_size=96, num_experts=16, num_experts_per_token=2,
        num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True,
        linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "head_dim": 32,
                            "num_heads": 4, "short_conv_kernel_size": 4},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # random weights with some spread, so greedy outputs are not degenerate
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return model


@torch.inference_mode()
def bench_hf(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float, list[list[int]]]:
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    t = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    elapsed = time.perf_counter() - t
    return ttft, elapsed, out[:, prompts.shape[1]:].tolist()


def bench_k3(model, prompts: list[list[int]], new_tokens: int, budget: int) -> tuple[float, float, list[list[int]]]:
    engine = LLMEngine(model, EngineConfig(max_num_seqs=len(prompts), max_num_batched_tokens=budget,
                                           enable_prefix_caching=False))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished:
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    return sum(first.values()) / len(first), elapsed, [r.output_token_ids for r in requests]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--record", type=Path, default=None, help="append the result to this markdown file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = kimi_linear(args.vocab)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_pretrained(d).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.prompts, args.prompt_len), generator=g)
    hf_ttft, hf_time, hf_out = bench_hf(hf, prompts, args.new_tokens)
    k3_ttft, k3_time, k3_out = bench_k3(ours, prompts.tolist(), args.new_tokens,
                                        budget=args.prompts * args.prompt_len)
    n = args.prompts * args.new_tokens
    agree = sum(a == b for x, y in zip(hf_out, k3_out) for a, b in zip(x, y)) / n
    rows = [("HF transformers generate", n / hf_time, hf_ttft), ("k3 engine", n / k3_time, k3_ttft)]
    device = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    cmd = "python bench/serve.py " + " ".join(sys.argv[1:])
    table = [f"| engine | tokens/s | TTFT (s) |", "|---|---|---|"]
    table += [f"| {name} | {tps:.1f} | {ttft:.3f} |" for name, tps, ttft in rows]
    summary = (f"k3/HF throughput ratio {rows[1][1] / rows[0][1]:.2f}x, TTFT ratio {k3_ttft / hf_ttft:.2f}x; "
               f"greedy tokens agreeing with HF: {agree:.1%}")
    if args.record:
        with open(args.record, "a") as f:
            f.write(f"\n## serve: k3 engine vs HF generate ({datetime.date.today()})\n\n"
                    f"`{cmd}` on {device}; {args.prompts} prompts x {args.prompt_len} tokens, "
                    f"{args.new_tokens} new tokens each, greedy, Kimi-Linear config (8 layers, d=128), "
                    f"torch {torch.__version__}, transformers {transformers.__version__}.\n\n"
                    + "\n".join(table) + f"\n\n{summary}\n")
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.new_tokens} new tokens, {device}")
    print(summary)
    print("\n".join(table))


if __name__ == "__main__":
    main()
