"""Tensors that stay fp32 whatever dtype the model is cast to (DESIGN §3, §6).

The router (`gate.weight`, `gate.e_score_correction_bias`) and the KDA decay parameters (`A_log`,
`dt_bias`) feed exponentials and top-k margins a few 1e-3 apart: bf16 would move which experts
are chosen and how fast state decays. transformers does the same with
`_keep_in_fp32_modules_strict`; the official checkpoint stores these in fp32.
"""
from __future__ import annotations

from torch import nn


class KeepsFP32(nn.Module):
    """Mixin: `model.to(dtype)` / `.half()` / `.bfloat16()` leave `FP32_TENSORS` in fp32 (device moves still apply)."""

    FP32_TENSORS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self.FP32_TENSORS:
            t = getattr(self, name)
            if t.is_floating_point() and t.dtype.itemsize < 4:
                t.data = t.data.float()
        return self


def fp32_tensor_names(model: nn.Module) -> set[str]:
    """State-dict names of every tensor some KeepsFP32 module pins to fp32: what loaders and
    exporters keep in fp32 whatever dtype they write the rest in (one list: the modules' own)."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() if isinstance(module, KeepsFP32)
            for name in module.FP32_TENSORS}
