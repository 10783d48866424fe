"""The training verb's user-facing error (a one-line `k3 train: error: ...`, exit code 2)."""
from __future__ import annotations


class TrainError(ValueError):
    """Bad settings or inputs; raised before anything is written."""
