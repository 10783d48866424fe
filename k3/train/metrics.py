"""Run observability: metrics.jsonl (one JSON object per event), loss.png and report.md.

Records: {"kind": "train", step, loss, lr, grad_norm, tokens, tok_per_s, elapsed, max_load},
{"kind": "eval", step, val_loss, val_bpb, val_tokens, val_bytes} (every eval reads the same held-out
windows, so val figures of one run are comparable), {"kind": "sample", step, prompt, text}.
`step` counts completed optimizer steps. On resume the file is cut back to the checkpoint's step,
so it always describes one uninterrupted run.
"""
from __future__ import annotations

import json
from pathlib import Path

from k3.atomic import write_atomic, write_text_atomic
from k3.train.errors import TrainError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
REPORT_FILE = "report.md"


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        """All records; an unparsable final line (a run killed during an append) is skipped, one
        anywhere else is corruption (TrainError)."""
        if not self.path.is_file():
            return []
        try:
            lines = [(i, line) for i, line in enumerate(self.path.read_text().splitlines(), 1) if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise TrainError(f"cannot read {self.path}: {e}") from None
        records = []
        for n, (lineno, line) in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                if n == len(lines) - 1:
                    break  # partial last line
                raise TrainError(f"{self.path}:{lineno}: not a metrics record")
            records.append(record)
        return records

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (written by a run that was then interrupted) and a
        partial last line."""
        self.rewrite([r for r in self.read() if r["step"] <= step])

    def rewrite(self, records: list[dict]) -> None:
        """Replace the whole log with `records` (atomically)."""
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in records))


def loss_figure(records: list[dict], title: str = "k3 train"):
    """Train loss per step and val loss per eval. Evals over different numbers of held-out tokens
    are not comparable, so each size is its own labelled series."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train loss (batch)")
    for n in sorted({r.get("val_tokens") for r in evals}, key=lambda n: n or 0):
        series = [r for r in evals if r.get("val_tokens") == n]
        label = f"val loss ({n:,} held-out tokens)" if n else "val loss"
        ax.plot([r["step"] for r in series], [r["val_loss"] for r in series], "o-", label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_losses(records: list[dict], path: Path, title: str = "k3 train") -> None:
    import matplotlib.pyplot as plt

    fig = loss_figure(records, title)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)


def write_report(path: Path, *, settings: dict, params: dict, records: list[dict], wall_time_s: float,
                 checkpoint: Path, title: str = "k3 training run", model: str | None = None, data: str | None = None,
                 batch: str | None = None, extra: list[str] = ()) -> None:
    """report.md; `extra` lines (markdown) go after the loss curve."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    samples = [r for r in records if r["kind"] == "sample"]
    last_eval = evals[-1] if evals else None
    default_batch = f"{settings['batch_size']} sequences x {settings['seq_len']} tokens"
    lines = [
        f"# {title}: {path.parent.name}", "",
        "| | |", "|---|---|",
        f"| model | {model or settings['config']} ({params['total'] / 1e6:.2f}M parameters, {params['active'] / 1e6:.2f}M active per token) |",
        f"| data | {data or settings['data'] or 'bundled Shakespeare corpus'} |",
        f"| steps | {train[-1]['step'] if train else 0} x {batch or default_batch} |",
        f"| tokens seen | {train[-1]['tokens'] if train else 0:,} |",
        f"| final train loss | {train[-1]['loss']:.4f} |" if train else "| final train loss | - |",
        (f"| final val loss / bits per byte | {last_eval['val_loss']:.4f} / {last_eval['val_bpb']:.4f} "
         f"(step {last_eval['step']}, {last_eval['val_tokens']:,} tokens) |") if last_eval else "| val | - |",
        f"| wall time | {wall_time_s / 60:.1f} min |",
        f"| checkpoint | `{checkpoint}` |", "",
        f"![loss curve]({PLOT_FILE})", "", *extra,
        "## Settings", "", "```json", json.dumps(settings, indent=2), "```", "",
    ]
    if samples:
        last_step = samples[-1]["step"]
        lines += [f"## Samples (step {last_step})", ""]
        for s in (s for s in samples if s["step"] == last_step):
            lines += ["```text", s["prompt"] + s["text"], "```", ""]
    write_text_atomic(path, "\n".join(lines))
