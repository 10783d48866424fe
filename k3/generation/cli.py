"""`k3 generate --run DIR --prompt TEXT`: sample from a trained run, streaming to the terminal.

DIR is a run folder (its latest checkpoint is used) or a checkpoint folder itself (`--model DIR`
says the same), a Kimi release as downloaded included: its generation_config.json gives the
sampling defaults and extra stop ids. Bytes are
decoded incrementally (tokenizers' DecodeStream), so a character split across tokens prints whole.
"""
from __future__ import annotations

import argparse
import sys

from tokenizers.decoders import DecodeStream

from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.run_folder import resolve_checkpoint
from k3.device import parse_device
from k3.generation.generate import generate
from k3.sampling import MAX_TEMPERATURE, check_sampling
from k3.text.model_folder import load_folder_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run folder (latest checkpoint) or a checkpoint folder")
    src.add_argument("--model", dest="run", metavar="DIR", help="a checkpoint folder, e.g. a Kimi release as downloaded")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (default 200)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json, else 0.8)")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: as --temperature, else 0.95)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = all (default: as "
                                                           "--temperature, else 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default="cpu", help="where to run the model: cpu, cuda or cuda:N (default cpu)")


def _bad_sampling(temperature: float, top_p: float, top_k: int, max_tokens: int) -> bool:
    try:
        check_sampling(temperature, top_p, top_k)
    except ValueError:
        return True
    return max_tokens < 1


def _sampling_error() -> int:
    print(f"k3 generate: error: need --max-tokens >= 1, 0 < --top-p <= 1, 0 <= --temperature <= "
          f"{MAX_TEMPERATURE:g}, --top-k >= 0", file=sys.stderr)
    return 2


def run(args) -> int:
    given = (0.0 if args.temperature is None else args.temperature, 1.0 if args.top_p is None else args.top_p,
             args.top_k or 0, args.max_tokens)
    if _bad_sampling(*given):  # the flags, checked before anything loads
        return _sampling_error()
    try:
        device = parse_device(args.device)
        folder = resolve_checkpoint(args.run)
        model = load_pretrained(folder, device=device).eval()
        text = load_folder_text(folder, model.config)
    except (OSError, ValueError) as e:  # not a checkpoint, a damaged one, no such device: one line
        print(f"k3 generate: error: {e}", file=sys.stderr)
        return 2
    g = text.generation  # flag, else generation_config.json, else the old defaults
    temperature = 0.0 if args.greedy else next(v for v in (args.temperature, g.temperature, 0.8) if v is not None)
    top_p = next(v for v in (args.top_p, g.top_p, 0.95) if v is not None)
    top_k = next(v for v in (args.top_k, g.top_k, 0) if v is not None)
    if _bad_sampling(temperature, top_p, top_k, args.max_tokens):
        return _sampling_error()
    tokenizer, cfg = text.tokenizer, model.config
    prompt = [cfg.bos_token_id] + tokenizer.encode(args.prompt, add_special_tokens=False).ids
    stream = DecodeStream(skip_special_tokens=True)

    def emit(_seq: int, token: int) -> None:
        piece = stream.step(tokenizer, token)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    sys.stdout.write(args.prompt)
    generate(model, [prompt], args.max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
             eos_token_id=[cfg.eos_token_id, *g.eos_token_ids], seed=args.seed, on_token=emit)
    sys.stdout.write("\n")
    return 0
