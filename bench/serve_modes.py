"""The k3 engine configurations bench.serve runs, as its tables label them, and the sentences its
results are reported in (bench.serve, bench.gpu_bench's serve table, bench.engine_host_profile).
Torch-free: a table can be rendered without loading the benchmark."""
from __future__ import annotations

# mode -> (label, EngineConfig.cuda_graphs, EngineConfig.compile); on CPU only "eager" runs
K3_MODES = {
    "graphs+compile": ("CUDA graphs, compiled regions", True, "inductor"),
    "graphs": ("CUDA graphs", True, None),
    "eager": ("eager", False, None),
}


def agreement_summary(result: dict) -> str:
    """How often each accelerated mode's greedy tokens equal the eager engine's."""
    return "".join(f"; k3 {mode} tokens equal to eager: {result[f'{mode}_agreement_with_eager']:.1%}"
                   for mode in K3_MODES if f"{mode}_agreement_with_eager" in result)


def mixed_line(m: dict) -> str:
    """One sentence on the mixed workload's result."""
    mode = m["mode"]
    return (f"mixed workload: {m['requests']} requests, prompts {m['prompt_lens'][0]}-{m['prompt_lens'][1]} tokens, "
            f"{m['new_tokens'][0]}-{m['new_tokens'][1]} new ({m['output_tokens']} in all), at most "
            f"{m['concurrency']} at a time: HF static batches {m['hf_tokens_per_s']:,.0f} tokens/s "
            f"({m['hf_useful_fraction']:.0%} of its decoded rows were asked for), k3 engine ({K3_MODES[mode][0]}) "
            f"{m[f'k3_{mode}_tokens_per_s']:,.0f} tokens/s, **{m[f'k3_{mode}_throughput_ratio']:.2f}x**, "
            f"mean TTFT {m[f'k3_{mode}_ttft_s']:.3f} s; greedy agreement with HF "
            f"{m[f'k3_{mode}_agreement_with_hf']:.1%}; engine forwards: {steps_line(m.get(f'k3_{mode}_steps', {}))}")


def steps_line(steps: dict[str, dict]) -> str:
    """The runner's forwards by kind (k3.serve.runner.STEP_KINDS): how many, and the seconds their
    steps took; the costliest kind first."""
    return ", ".join(f"{s['count']} {kind} in {s['seconds']:.1f} s"
                     + (f" (slowest {s['slowest_s']:.2f} s: {s['tokens']} tokens of {s['requests']} requests)"
                        if "slowest_s" in s else "")
                     for kind, s in sorted(steps.items(), key=lambda kv: -kv[1]["seconds"])) or "not recorded"
