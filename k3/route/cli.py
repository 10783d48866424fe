"""`k3 route`: an OpenAI-compatible front for N `k3 serve` replicas (docs/ROUTING.md).

    k3 route --replica http://127.0.0.1:8001 http://127.0.0.1:8002 --tokenizer RUN/.../tokenizer.json
    k3 route --spawn 3 --run RUN [--serve-args "--cache-mb 256"]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import time

from k3.route.admission import Budgets
from k3.route.affinity import DEFAULT_AFFINITY_BLOCKS
from k3.route.hashing import DEFAULT_VNODES
from k3.route.policy import POLICIES

DEFAULT_HASH_BLOCK_SIZE = 64  # `k3 serve --hash-block-size`'s default (EngineConfig)
DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # `k3 serve --max-request-bytes`'s default


def add_arguments(p: argparse.ArgumentParser) -> None:
    fleet = p.add_mutually_exclusive_group(required=True)
    fleet.add_argument("--replica", nargs="+", action="extend", metavar="URL",
                       help="a running `k3 serve` (repeatable), e.g. http://127.0.0.1:8001")
    fleet.add_argument("--spawn", type=int, metavar="N", help="start N `k3 serve` replicas on loopback ports")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="the `k3 train` run the replicas serve (--spawn serves it; its tokenizer keys "
                                   "sessions)")
    src.add_argument("--model", help="the HF-layout checkpoint the replicas serve (as --run)")
    p.add_argument("--tokenizer", help="the replicas' tokenizer.json (default: the --run/--model one; without any, "
                                       "prompts are keyed on their bytes)")
    p.add_argument("--serve-args", default="", metavar="ARGS",
                   help='more `k3 serve` options for --spawn, one string, e.g. "--cache-mb 256 --max-model-len 2048"')
    p.add_argument("--replica-threads", type=int, metavar="N",
                   help="CPU threads of each spawned replica (default: the CPUs shared out, at least 1)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--policy", default="affinity", choices=POLICIES,
                   help="affinity: consistent hashing of the session key (default); round_robin, random: baselines")
    p.add_argument("--hash-block-size", type=int, default=DEFAULT_HASH_BLOCK_SIZE,
                   help="the replicas' --hash-block-size (prompt keys are the engine's block hashes)")
    p.add_argument("--affinity-blocks", type=int, default=DEFAULT_AFFINITY_BLOCKS,
                   help="hash blocks of a session's opening that make its key (default %(default)s)")
    p.add_argument("--vnodes", type=int, default=DEFAULT_VNODES, help="ring points per replica")
    b = Budgets()
    p.add_argument("--long-prompt-tokens", type=int, default=b.long_prompt_tokens,
                   help="a prompt this long or longer is admitted as long (default %(default)s)")
    p.add_argument("--short-budget", type=int, default=b.short,
                   help="prompt tokens of short requests in flight per replica (default %(default)s)")
    p.add_argument("--long-budget", type=int, default=b.long,
                   help="prompt tokens of long requests in flight per replica (default %(default)s)")
    p.add_argument("--long-prefills", type=int, default=b.long_prefills,
                   help="long prompts in prefill at once per replica (default %(default)s)")
    p.add_argument("--short-replicas", type=int, default=b.short_replicas,
                   help="replicas kept free of long prompts' prefill for short requests (default %(default)s)")
    p.add_argument("--admission-timeout", type=float, default=b.timeout,
                   help="seconds a request may wait for its budget, then HTTP 429 (default %(default)s)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--replica-timeout", type=float, default=600.0,
                   help="seconds without a byte from a replica before its reply counts as failed (default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for spawned replicas to come up (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("K3_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $K3_API_KEY, else none)")
    p.add_argument("--replica-api-key", help="the key the replicas require, if any")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (beyond it: HTTP 413); default %(default)s")
    p.add_argument("--log-level", default="info")


def _fail(message) -> int:
    print(f"k3 route: error: {message}", file=sys.stderr)
    return 2


def _tokenizer(args):
    """The tokenizer that keys prompts, or None."""
    from k3.serve.model_source import checkpoint_folder, tokenizer_path
    from k3.text.tokenizer import load_tokenizer

    if args.tokenizer is None and args.run is None and args.model is None:
        return None
    path = tokenizer_path(checkpoint_folder(args.run, args.model), args.tokenizer) if args.tokenizer is None \
        else args.tokenizer
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on a malformed file)
        raise ValueError(f"{path} is not a readable tokenizer file ({e})") from None


def _spawn_commands(args) -> dict[str, list[str]]:
    from k3.route.replicas import free_port, serve_command
    from k3.threads import available_cpus

    if args.run is None and args.model is None:
        raise ValueError("--spawn needs --run or --model (what the replicas serve)")
    serve_args = ["--run", args.run] if args.run else ["--model", args.model]
    if args.tokenizer:
        serve_args += ["--tokenizer", args.tokenizer]
    extra = shlex.split(args.serve_args)
    if "--log-level" not in extra:
        extra += ["--log-level", "warning"]
    threads = args.replica_threads or max(1, available_cpus() // args.spawn)
    commands = {}
    for _ in range(args.spawn):
        port = free_port()
        commands[f"http://127.0.0.1:{port}"] = serve_command(serve_args + extra, port, threads)
    return commands


def _budgets(args) -> Budgets:
    return Budgets(args.long_prompt_tokens, args.short_budget, args.long_budget, args.admission_timeout,
                   args.short_replicas, args.long_prefills)


def _check(args) -> None:
    _budgets(args)
    for name in ("spawn", "replica_threads", "max_request_bytes", "hash_block_size", "affinity_blocks", "vnodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("health_interval", "replica_timeout", "startup_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


async def _first_checks(replicas, spawned: bool, timeout: float) -> None:
    """A URL that answers but is not a k3 server fails here (NotAK3Server); spawned replicas are
    waited for, and one that exits fails here too."""
    deadline = time.monotonic() + timeout
    try:
        await _wait_up(replicas, spawned, deadline, timeout)
    finally:
        await replicas.client.aclose()  # bound to this event loop; the server gets its own


async def _wait_up(replicas, spawned: bool, deadline: float, timeout: float) -> None:
    while True:
        for url in replicas.replicas:
            await replicas.check(url)
        if not spawned or all(r.up for r in replicas.replicas.values()):
            return
        for url, r in replicas.replicas.items():
            if r.process is not None and r.process.poll() is not None:
                raise ValueError(f"spawned replica {url} exited with code {r.process.returncode} "
                                 f"(run `{shlex.join(r.command[1:])}` alone to see why)")
        if time.monotonic() > deadline:
            raise ValueError(f"spawned replicas not up after {timeout:g} s")
        await asyncio.sleep(0.5)


def run(args) -> int:
    import httpx
    import uvicorn

    from k3.route.admission import Admission
    from k3.route.affinity import PromptKeys
    from k3.route.app import Router, build_app
    from k3.route.policy import Policy
    from k3.route.replicas import NotAK3Server, ReplicaSet, check_url, spawn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    try:
        _check(args)
        keys = PromptKeys(_tokenizer(args), args.hash_block_size, args.affinity_blocks)
        commands = _spawn_commands(args) if args.spawn else {}
        urls = list(commands) or list(dict.fromkeys(check_url(u) for u in args.replica))
    except (ValueError, OSError) as e:
        return _fail(e)
    headers = {"content-type": "application/json"}
    if args.replica_api_key:
        headers["authorization"] = f"Bearer {args.replica_api_key}"
    timeout = httpx.Timeout(connect=2.0, read=args.replica_timeout, write=30.0, pool=None)

    def client():
        return httpx.AsyncClient(timeout=timeout, headers=headers, limits=httpx.Limits(max_connections=None))

    replicas = ReplicaSet(urls, client())
    spawn(replicas, commands)
    try:
        try:
            asyncio.run(_first_checks(replicas, bool(commands), args.startup_timeout))
        except (NotAK3Server, ValueError) as e:
            return _fail(e)
        for url, r in replicas.replicas.items():
            if not r.up:
                logging.getLogger("k3.route").warning("replica %s is down for now (%s): checked every %g s",
                                                      url, r.last_error, args.health_interval)
        replicas.client = client()  # the first one belonged to the checks' event loop
        router = Router(replicas, Policy(args.policy, urls, args.vnodes), Admission(_budgets(args)), keys, replicas.client,
                        headers, args.health_interval)
        app = build_app(router, api_key=args.api_key, max_request_bytes=args.max_request_bytes)
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            logging.getLogger("k3.route").warning("binding %s: the router is reachable from other machines", args.host)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        replicas.stop_spawned()
    return 0
