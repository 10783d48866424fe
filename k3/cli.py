"""`k3 VERB ...`: thin verbs; each lives in the module that owns the work and exposes
`add_arguments(parser)` and `run(args) -> int`. Modules are imported lazily so `k3 params` never
loads the serving stack."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "params": ("k3.params_cli", "count parameters of a config (total / activated per token)"),
    "train": ("k3.train.cli", "train a model (default: k3-tiny on the bundled corpus, CPU)"),
    "generate": ("k3.generation.cli", "sample from a trained run"),
    "serve": ("k3.serve.cli", "OpenAI-compatible HTTP server"),
    "chat": ("k3.serve.chat_cli", "chat with a model in the terminal"),
    "quantize": ("k3.checkpoint.quantize_cli", "convert a checkpoint to the MXFP4 packed layout"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        sys.exit(0)
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    module_name, help_text = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    verb = argparse.ArgumentParser(prog=f"k3 {argv[0]}", description=help_text)
    module.add_arguments(verb)
    args = verb.parse_args(argv[1:])
    sys.exit(module.run(args) or 0)
