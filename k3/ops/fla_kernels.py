"""Whether flash-linear-attention's Triton kernels (fla-core, the `cuda` extra) can run here: they
import only where triton does, never on our CPU machines. Checked once per process."""
from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True
