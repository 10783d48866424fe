"""CUDA-graph decode (k3/model/decode_graph.py) is checked on the GPU (bench/gpu_checks.py, model
decode); here: what it refuses, with a message that says why."""
import pytest

from k3.config import load_config
from k3.model.cache import K3Cache
from k3.model.decode_graph import CUDAGraphDecoder, capturable_experts
from k3.model.transformer import K3ForCausalLM


def test_refuses_cpu_models_and_host_synchronizing_experts():
    model = K3ForCausalLM(load_config("k3-tiny")).eval()
    assert not capturable_experts(model)  # CPU: the per-expert loop reads counts on the host
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphDecoder(model, K3Cache.empty(model.config, 1, capacity=8))
