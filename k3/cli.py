"""`k3 VERB ...`: thin verbs; each lives in the module that owns the work and exposes
`add_arguments(parser)` and `run(args) -> int`. Modules are imported lazily so `k3 params` never
loads the serving stack.

Nothing here imports torch: the CPU thread count and OpenMP wait policy (k3/threads.py) must be in
the environment before torch loads, so they are set before the verb's module is imported.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import k3
from k3.threads import SERVING_VERBS, ThreadsError, configure

COMMANDS = {
    "params": ("k3.params_cli", "count parameters of a config (total / activated per token)"),
    "train": ("k3.train.cli", "train a model (default: k3-tiny on the bundled corpus, CPU)"),
    "train-draft": ("k3.draft.cli", "train a speculative-decoding draft on a run's own outputs"),
    "sft": ("k3.sft.cli", "fine-tune a run on conversations in K3's chat format (default: a tool-use set)"),
    "rl": ("k3.rl.cli", "train an RL expert (domain x effort) from an SFT run: partial rollout, effort budgets"),
    "distill": ("k3.rl.distill_cli", "merge RL experts into one student by multi-teacher on-policy distillation"),
    "generate": ("k3.generation.cli", "sample from a trained run"),
    "serve": ("k3.serve.cli", "OpenAI-compatible HTTP server"),
    "chat": ("k3.serve.chat_cli", "chat with a model in the terminal"),
    "route": ("k3.route.cli", "OpenAI-compatible front for several `k3 serve` replicas: affinity, failover"),
    "quantize": ("k3.checkpoint.quantize_cli", "convert a checkpoint to the MXFP4 packed layout"),
    "plan": ("k3.parallel.plan_cli", "size DP x EP x CP x PP layouts: memory, communication, step time"),
    "ablate": ("k3.ablate.cli", "run a small-scale ablation study of a K3 component over seeds"),
}
THREADS_HELP = ("CPU threads for torch; overrides $K3_NUM_THREADS, which overrides $OMP_NUM_THREADS "
                "(default: the CPUs available to this process less one; idle threads sleep, OMP_WAIT_POLICY=PASSIVE)")


def _threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", metavar="N", help=THREADS_HELP)


def _split_threads(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--threads N` / `--threads=N` anywhere before a `--`, and the arguments without it."""
    threads, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == "--threads":
            if i + 1 >= len(argv):
                raise ThreadsError("--threads expects a number")
            threads, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--threads="):
            threads = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    return threads, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch",
                                     usage="k3 [--threads N] COMMAND [options]")
    parser.add_argument("--version", action="version", version=f"k3 {k3.__version__}")
    _threads_option(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    try:
        threads, rest = _split_threads(argv)
    except ThreadsError as e:
        parser.error(str(e))
    if not rest or rest[0] in ("-h", "--help", "--version"):
        parser.parse_args(rest or ["--help"])  # prints help or the version and exits
    if rest[0] not in COMMANDS:
        parser.error(f"unknown command {rest[0]!r}; choose from {', '.join(COMMANDS)}")
    try:
        choice = configure(threads, serving=rest[0] in SERVING_VERBS)  # before the verb's module imports torch
    except ThreadsError as e:
        print(f"k3 {rest[0]}: error: {e}", file=sys.stderr)
        sys.exit(2)
    module_name, help_text = COMMANDS[rest[0]]
    module = importlib.import_module(module_name)
    # no abbreviations: `--thr 2` would reach the verb's listed --threads after the choice was made
    verb = argparse.ArgumentParser(prog=f"k3 {rest[0]}", description=help_text, allow_abbrev=False)
    module.add_arguments(verb)
    _threads_option(verb)  # listed in the verb's --help; taken out of argv above
    args = verb.parse_args(rest[1:])
    del args.threads
    if _is_main_rank():
        print(choice.describe(), file=sys.stderr, flush=True)
    sys.exit(module.run(args) or 0)


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"
