"""`k3 serve`: the OpenAI-compatible server for a `k3 train` run or an HF-layout checkpoint."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from k3.serve.api.gate import DEFAULT_MAX_REQUEST_BYTES
from k3.serve.engine import MAX_SPECULATIVE_TOKENS, EngineConfig, LLMEngine

DEFAULT_SPECULATIVE_TOKENS = 4


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model source and engine knobs, shared by `k3 serve` and `k3 chat`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a `k3 train` run folder (serves its latest checkpoint)")
    src.add_argument("--model", help="an HF-layout checkpoint folder (K3 or Kimi Linear)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="where to run the model: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    d = EngineConfig()
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per MLA page")
    p.add_argument("--hash-block-size", type=int, default=d.hash_block_size, help="prefix-hash granularity (tokens)")
    p.add_argument("--cache-mb", type=int, default=d.cache_bytes >> 20, help="page pool size")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="per-step budget")
    p.add_argument("--max-num-encoder-tokens", type=int, default=None, metavar="N",
                   help="per-step budget of image placeholders whose encoding a step may start (vision models; "
                        "default: --max-num-batched-tokens)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="queue bound (beyond it: HTTP 429)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--host-cache-gb", type=float, default=0.0, metavar="GB",
                   help="host-memory tier of the prefix cache (pinned on CUDA): evicted prefixes are written "
                        "back there and prefetched on a later hit instead of recomputed (default 0: none)")
    p.add_argument("--admission", choices=["auto", "fixed"], default=d.admission,
                   help="auto: admit while the running requests' projected pages fit the pool (docs/SERVING.md); "
                        "fixed: admit until --max-num-seqs or the pool is full, preempting when it overflows")
    p.add_argument("--admission-target-usage", type=float, default=d.admission_target_usage, metavar="F",
                   help="auto admission: share of the pool the projected pages may fill (default %(default)s)")
    p.add_argument("--admission-output-ratio", type=float, default=d.admission_output_ratio, metavar="F",
                   help="auto admission: share of each request's remaining max_tokens reserved at first "
                        "(default %(default)s; 1 after a preemption)")
    p.add_argument("--admission-min-output-ratio", type=float, default=d.admission_min_output_ratio, metavar="F",
                   help="auto admission: the least share reserved (default %(default)s)")
    p.add_argument("--admission-ratio-decay", type=float, default=d.admission_ratio_decay, metavar="F",
                   help="auto admission: how much the reserved share falls per step without a preemption "
                        "(default %(default)s)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly (default on CUDA: replay lasting decode batches from CUDA graphs)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each layer's norms, mixer, FFN and AttnRes reads (inductor) before "
                        "serving: shorter decode steps on CUDA once each shape has compiled (off by default: "
                        "docs/SERVING.md has what it measured)")
    p.add_argument("--no-fuse-projections", action="store_true",
                   help="run each input projection of a KDA or MLA layer as its own GEMM (default: one GEMM per "
                        "layer over the concatenated weights, docs/SERVING.md)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft", help="a speculative draft folder (`k3 train-draft` writes RUN/draft): decode with "
                                   "speculation, verified by the model (same outputs in greedy, same distribution "
                                   "when sampling)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"tokens the draft proposes per step, 1..{MAX_SPECULATIVE_TOKENS} (default 4 with --draft)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="compute every token with the same arithmetic whatever the batch, chunking or "
                        "speculation: outputs reproducible bit for bit, greedy with --draft equal to greedy "
                        "without it token for token (CPU only, several times slower)")


def check_engine_settings(args) -> None:
    """Bad speculation, batch-invariance or host-tier settings, refused before anything loads (one line)."""
    if args.host_cache_gb < 0:
        raise ValueError(f"--host-cache-gb must be >= 0, got {args.host_cache_gb}")
    if args.batch_invariant and args.device != "cpu":
        raise ValueError(f"--batch-invariant is CPU-only, got --device {args.device}")
    if args.batch_invariant and args.compile:
        raise ValueError("--batch-invariant and --compile exclude each other")
    k = args.num_speculative_tokens
    if k is not None and args.draft is None:
        raise ValueError("--num-speculative-tokens needs --draft DIR (a `k3 train-draft` folder)")
    if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")


def build_engine(model, args) -> LLMEngine:
    """The engine for the loaded model, with its draft when --draft is given (checked against the
    model: k3.checkpoint.draft_folder.DraftError, a ValueError, names the mismatch)."""
    from k3.checkpoint.draft_folder import load_draft

    # a vision model's draft is its language model's (`k3 train-draft` on the run reads that alone)
    draft = None if args.draft is None else load_draft(args.draft, getattr(model, "language_model", model))
    return LLMEngine(model, engine_config(args), draft=draft)


def engine_config(args) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, hash_block_size=args.hash_block_size,
                        cache_bytes=args.cache_mb << 20, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_encoder_tokens=args.max_num_encoder_tokens, max_model_len=args.max_model_len,
                        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
                        cuda_graphs=not args.no_cuda_graphs, compile="inductor" if args.compile else None,
                        fuse_projections=not args.no_fuse_projections,
                        seed=args.seed, num_speculative_tokens=0 if args.draft is None
                        else args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
                        batch_invariant=args.batch_invariant, host_cache_bytes=int(args.host_cache_gb * 2**30),
                        admission=args.admission, admission_target_usage=args.admission_target_usage,
                        admission_output_ratio=args.admission_output_ratio,
                        admission_min_output_ratio=args.admission_min_output_ratio,
                        admission_ratio_decay=args.admission_ratio_decay)


# what loading a bad --run / --model / --tokenizer raises (a missing or corrupted file, a checkpoint
# that does not match its config: k3.checkpoint's errors are ValueErrors): one line, not a traceback
LOAD_ERRORS = (ValueError, OSError)


def usage_error(command: str, e: BaseException) -> int:
    print(f"k3 {command}: error: {e}", file=sys.stderr)
    return 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("K3_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $K3_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model id clients use (default: the run/checkpoint name)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted (beyond it: HTTP 413); default %(default)s")
    p.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='chat template options for requests that send none, e.g. \'{"thinking": false}\' '
                        "(default: what the --run was trained with, else the template's: thinking on)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                   help="fetch http(s) image URLs from these host names (exact match); default: fetch nothing")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs from any host (the server can then be made to reach hosts "
                        "its clients cannot: prefer --allowed-media-domains)")
    p.add_argument("--media-fetch-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="deadline for fetching one image, redirects included (default %(default)s)")
    p.add_argument("--log-level", default="info")


def media_fetch_policy(args):
    """The FetchPolicy the flags ask for, None when fetching is off; ValueError in one line."""
    from k3.serve.api.media_fetch import FetchPolicy

    if args.allow_remote_images and args.allowed_media_domains:
        raise ValueError("--allow-remote-images and --allowed-media-domains exclude each other")
    if not (args.allow_remote_images or args.allowed_media_domains):
        return None
    return FetchPolicy(frozenset(args.allowed_media_domains) if args.allowed_media_domains else None,
                       timeout=args.media_fetch_timeout)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object, or a one-line error."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def run(args) -> int:
    from k3.serve.api.server import build_app, chat_template_defaults, run_server
    from k3.serve.engine import AsyncEngine
    from k3.serve.loading import load_for_serving, run_chat_defaults

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.max_request_bytes < 1:
        return usage_error("serve", ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}"))
    try:
        check_engine_settings(args)
        chat_template_defaults(args.default_chat_template_kwargs)  # a bad value fails before the model loads
        media_fetch = media_fetch_policy(args)
        served = load_for_serving(args.run, args.model, args.tokenizer, args.device, args.dtype)
        model, tokenizer, name = served.model, served.tokenizer, served.name
        engine = AsyncEngine(build_engine(model, args), tokenizer)
    except LOAD_ERRORS as e:
        return usage_error("serve", e)
    chat_defaults = args.default_chat_template_kwargs
    if chat_defaults is None:
        chat_defaults = run_chat_defaults(args.run)
        if chat_defaults:
            logging.getLogger("k3.serve").info("chat requests without chat_template_kwargs: %s (as the run was "
                                               "trained; --default-chat-template-kwargs overrides)", chat_defaults)
    if media_fetch is not None:
        logging.getLogger("k3.serve").warning(
            "image URLs are fetched from %s (timeout %g s)", ", ".join(sorted(media_fetch.allowed_domains))
            if media_fetch.allowed_domains else "any host", media_fetch.timeout)
    app = build_app(engine, tokenizer, model_name=args.served_model_name or name, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, default_chat_template_kwargs=chat_defaults,
                    media_fetch=media_fetch, chat=served.chat, generation=served.generation)
    run_server(app, args.host, args.port)
    return 0
