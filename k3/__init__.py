"""k3: Kimi K3 in PyTorch — the model, its training and its serving."""
from k3.config import K3Config, load_config

__all__ = ["K3Config", "load_config"]
__version__ = "0.1.0"
