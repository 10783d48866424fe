"""Whether flash-linear-attention's Triton kernels (fla-core, the `cuda` extra) can run here: they
import only where triton does, never on our CPU machines. Checked once per process; the first
import also seeds fla's autotuners with the recorded Hopper choices (k3.ops.fla_tuning)."""
from __future__ import annotations

_available: bool | None = None  # a plain global, not functools.cache: dynamo reads it as a constant


def available() -> bool:
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> bool:
    try:
        import fla.modules.causal_conv1d
        import fla.modules.norm.fused_norm_gate
        import fla.ops.kda  # noqa: F401 (imported to probe; the backends import it again)
    except ImportError:
        return False
    from k3.ops import fla_tuning

    fla_tuning.seed()
    return True
