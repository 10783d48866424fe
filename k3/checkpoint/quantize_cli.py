"""`k3 quantize --model DIR --out DIR`: a dense checkpoint -> the official MXFP4 packed layout.

Routed experts become MXFP4 (K3 ceil rule), everything else bf16 (k3/checkpoint/packed.py);
tokenizer files are copied along so the output serves on its own. Prints the per-layer relative
error table and writes it to DIR/quantization_report.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from k3.checkpoint.official import DEFAULT_SHARD_BYTES, load_pretrained
from k3.checkpoint.packed import is_packed_checkpoint, save_packed
from k3.checkpoint.quantize_report import KINDS, quantization_report

REPORT_FILE = "quantization_report.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="dense checkpoint folder (config.json + safetensors)")
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


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.model), Path(args.out)
    if not (src / "config.json").is_file():
        print(f"k3 quantize: {src} has no config.json")
        return 2
    if is_packed_checkpoint(src):
        print(f"k3 quantize: {src} is already quantized (its config.json has a quantization_config)")
        return 2
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"k3 quantize: output {out} exists and is not an empty folder")
        return 2
    model = load_pretrained(src)
    rows = quantization_report(model)
    save_packed(model, out, max_shard_bytes=args.max_shard_bytes)
    for f in sorted(src.glob("tokenizer*")):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    (out / REPORT_FILE).write_text(json.dumps(rows, indent=2) + "\n")
    _print_report(rows)
    print(f"wrote {out} (MXFP4 routed experts, bf16 elsewhere); report in {out / REPORT_FILE}")
    return 0
