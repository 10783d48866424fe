"""The K3 text model: single-device math (no parallelism, no serving types, no file I/O)."""
from k3.model.cache import K3Cache
from k3.model.transformer import K3ForCausalLM

__all__ = ["K3Cache", "K3ForCausalLM"]
