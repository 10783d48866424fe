"""`k3 quantize --model DIR --out DIR`: a dense checkpoint -> the official MXFP4 packed layout.

DIR is a checkpoint folder or a `k3 train` run folder (its latest checkpoint). A multimodal one
(vision_tower tensors beside a vision_config) keeps its tower and projector, in bf16 as published.

Routed experts become MXFP4 (K3 ceil rule), everything else bf16 (k3/checkpoint/packed.py);
tokenizer files are copied along so the output serves on its own. Prints the per-layer relative
error table and writes it to DIR/quantization_report.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from k3.checkpoint.files import DEFAULT_SHARD_BYTES
from k3.checkpoint.multimodal import is_multimodal_checkpoint, load_pretrained_multimodal, save_packed_multimodal
from k3.checkpoint.official import state_dict_to_official
from k3.checkpoint.packed import check_packable, is_packed_checkpoint, save_packed
from k3.checkpoint.pretrained import load_pretrained
from k3.checkpoint.quantize_report import KINDS, quantization_report
from k3.checkpoint.run_folder import resolve_checkpoint

REPORT_FILE = "quantization_report.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="dense checkpoint folder (config.json + safetensors) "
                                                       "or a `k3 train` run folder (its latest checkpoint)")
    parser.add_argument("--out", required=True, help="output folder (must be new or empty)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="safetensors shard size")


def _print_report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="MXFP4 relative error RMSE(W - Q(W)) / RMSE(W), routed experts")
    for col in ("layer", "experts", *KINDS, "worst matrix"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["layer"]), str(r["experts"]), *(f"{r[k]:.4f}" for k in KINDS),
                      f"{r['worst']:.4f} {r['worst_name'].split('block_sparse_moe.')[-1]}")
    Console().print(table)


def _error(message: str) -> int:
    print(f"k3 quantize: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.max_shard_bytes < 1:
        return _error(f"--max-shard-bytes must be >= 1, got {args.max_shard_bytes}")
    try:
        src = resolve_checkpoint(args.model)
        if is_packed_checkpoint(src):
            return _error(f"{src} is already quantized (its config.json has a quantization_config)")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            return _error(f"output {out} exists and is not an empty folder")
        multimodal = is_multimodal_checkpoint(src)
        model = load_pretrained_multimodal(src) if multimodal else load_pretrained(src)
        text = model.language_model if multimodal else model
        check_packable(state_dict_to_official(text))
        rows = quantization_report(text)
    except (FileNotFoundError, ValueError) as e:  # not a checkpoint, a damaged or mismatched one
        return _error(str(e))
    # written beside the output and renamed into place: a failed or killed run leaves no half checkpoint
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        (save_packed_multimodal if multimodal else save_packed)(model, tmp, max_shard_bytes=args.max_shard_bytes)
        for f in sorted(src.glob("tokenizer*")):
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        (tmp / REPORT_FILE).write_text(json.dumps(rows, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return _error(f"cannot write {out}: {e.strerror or e}")
    _print_report(rows)
    vision = ", vision tower and projector bf16" if multimodal else ""
    print(f"wrote {out} (MXFP4 routed experts, bf16 elsewhere{vision}); report in {out / REPORT_FILE}")
    return 0
