"""The one error the sandbox layer raises: a one-line message saying what failed and why."""
from __future__ import annotations


class SandboxError(RuntimeError):
    """A sandbox operation failed (setup, a refused path, a closed or paused sandbox, an unknown
    snapshot); exec results of the sandboxed command itself are never errors, they are ExecResults."""
