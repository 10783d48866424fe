"""The K3 text model: single-device math (no parallelism, no serving types)."""
from k3.model.cache import K3Cache
from k3.model.checkpoint import load_pretrained, save_pretrained
from k3.model.generate import generate
from k3.model.transformer import K3ForCausalLM

__all__ = ["K3Cache", "K3ForCausalLM", "generate", "load_pretrained", "save_pretrained"]
