"""`k3 params`: the parameter breakdown of a preset or config.json (k3/model/params.py counts)."""
from __future__ import annotations

import json
import sys

from k3.config import ConfigError, load_config
from k3.model.multimodal import vision_config_of
from k3.model.params import count_parameters, count_vision_parameters


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="k3", help="preset name (k3, k3-tiny, k3-1b) or config.json path/dir")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (keys: total, active, components; vision when the config has a vision_config)")


def _configs(name: str):
    """(text config, vision config or None) of a preset, VL preset or config.json."""
    from k3.train.vl_config import VL_PRESETS, load_vl_config

    if name in VL_PRESETS:
        mm = load_vl_config(name)
        return mm.text_config, mm.vision_config
    config = load_config(name)
    return config, vision_config_of(config)


def run(args) -> int:
    try:
        config, vision_config = _configs(args.config)
    except (ConfigError, OSError, TypeError, ValueError) as e:  # unknown name, unreadable or invalid config.json
        print(f"k3 params: error: {e}", file=sys.stderr)
        return 2
    counts = count_parameters(config)
    if vision_config is not None:  # a multimodal config.json: the encoder is counted apart (DESIGN §7, §10)
        counts["vision"] = count_vision_parameters(vision_config)
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parameters of {args.config}")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, n in counts["components"].items():
        table.add_row(name, f"{n:,}", f"{100 * n / counts['total']:.2f}%")
    table.add_row("[bold]total[/bold]", f"[bold]{counts['total']:,}[/bold]", f"{_human(counts['total'])}")
    table.add_row("[bold]active per token[/bold]", f"[bold]{counts['active']:,}[/bold]", f"{_human(counts['active'])}")
    console = Console()
    console.print(table)
    console.print(f"convention: {counts['convention']}")
    if "vision" in counts:
        vision = counts["vision"]
        vt = Table(title="vision encoder (vision_config; not in the text total)")
        vt.add_column("component")
        vt.add_column("parameters", justify="right")
        vt.add_column("", justify="right")
        vt.add_row("vision_tower (MoonViT)", f"{vision['vision_tower']:,}", _human(vision["vision_tower"]))
        vt.add_row("mm_projector", f"{vision['mm_projector']:,}", _human(vision["mm_projector"]))
        vt.add_row("[bold]vision total[/bold]", f"[bold]{vision['total']:,}[/bold]", _human(vision["total"]))
        both = counts["total"] + vision["total"]
        vt.add_row("[bold]text + vision[/bold]", f"[bold]{both:,}[/bold]", _human(both))
        console.print(vt)
    return 0


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
