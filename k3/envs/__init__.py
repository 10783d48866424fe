"""Sandboxed agent environments for RL (K3 report §7.3, AgentENV): see k3/envs/sandbox.py."""
from k3.envs.errors import SandboxError
from k3.envs.limits import Limits
from k3.envs.pool import SandboxPool
from k3.envs.sandbox import ExecResult, Sandbox

__all__ = ["ExecResult", "Limits", "Sandbox", "SandboxError", "SandboxPool"]
