"""k3: Kimi K3 in PyTorch — the model, its training and its serving.

    from k3 import K3Config, K3ForCausalLM, K3Cache, generate
    model = K3ForCausalLM.from_pretrained(path)   # ours, official K3, MXFP4-packed or Kimi-Linear
    model.save_pretrained(out)                    # the official layout

    from k3 import K3ForConditionalGeneration    # the text model with MoonViT and its projector
    vl = K3ForConditionalGeneration.from_pretrained(path)  # the official three-prefix layout

The model names load lazily: `import k3` (which `k3 VERB` does before choosing CPU threads) must
not import torch (k3/threads.py). Each is the model's own class; importing it from here imports its
checkpoint format, which gives it `from_pretrained` and `save_pretrained` (k3/model/pretrained.py).
"""
from k3.config import K3Config, load_config

__all__ = ["K3Cache", "K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "generate", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "K3ForCausalLM":
        # the model's class, through the module that registers its checkpoint format
        from k3.checkpoint.pretrained import K3ForCausalLM
        return K3ForCausalLM
    if name == "K3ForConditionalGeneration":
        from k3.checkpoint.multimodal import K3ForConditionalGeneration
        return K3ForConditionalGeneration
    if name == "K3Cache":
        from k3.model.cache import K3Cache
        return K3Cache
    if name == "generate":
        from k3.generation.generate import generate
        return generate
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
