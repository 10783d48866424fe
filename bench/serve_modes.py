"""The k3 engine configurations bench/serve.py runs, as its tables label them. Torch-free, so
bench/gpu_run.py's report can import it without loading the benchmark."""
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
