"""`k3 generate --run DIR --prompt TEXT`: sample from a trained run, streaming to the terminal.

DIR is a run folder (its latest checkpoint is used) or a checkpoint folder itself. Bytes are
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
from k3.text.tokenizer import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run folder (latest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=200, help="new tokens at most (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--device", default="cpu", help="where to run the model: cpu, cuda or cuda:N (default cpu)")


def run(args) -> int:
    try:
        check_sampling(args.temperature, args.top_p, args.top_k)
        ok = args.max_tokens >= 1
    except ValueError:
        ok = False
    if not ok:
        print(f"k3 generate: error: need --max-tokens >= 1, 0 < --top-p <= 1, 0 <= --temperature <= "
              f"{MAX_TEMPERATURE:g}, --top-k >= 0", file=sys.stderr)
        return 2
    try:
        device = parse_device(args.device)
        folder = resolve_checkpoint(args.run)
        tokenizer = load_tokenizer(folder)
        model = load_pretrained(folder, device=device).eval()
    except (OSError, ValueError) as e:  # not a checkpoint, a damaged one, no such device: one line
        print(f"k3 generate: error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    prompt = [cfg.bos_token_id] + tokenizer.encode(args.prompt).ids
    stream = DecodeStream(skip_special_tokens=True)

    def emit(_seq: int, token: int) -> None:
        piece = stream.step(tokenizer, token)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    sys.stdout.write(args.prompt)
    generate(model, [prompt], args.max_tokens, temperature=0.0 if args.greedy else args.temperature,
             top_p=args.top_p, top_k=args.top_k, eos_token_id=cfg.eos_token_id, seed=args.seed, on_token=emit)
    sys.stdout.write("\n")
    return 0
