"""`--device` as every verb takes it: cpu, cuda or cuda:N, checked against this machine."""
from __future__ import annotations

import torch


def parse_device(device: str) -> torch.device:
    """The torch.device for `device`; ValueError (one line) when it is malformed or absent here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} requested but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev
