"""An RL or distillation run's plot (loss.png) and report.md: reward and held-out accuracy, lengths
against the budget, and how far the policy moved (clip fraction, staleness, behaviour KL)."""
from __future__ import annotations

import json
from pathlib import Path

from k3.atomic import write_atomic, write_text_atomic
from k3.train.metrics import PLOT_FILE, REPORT_FILE


def plot_rl(records: list[dict], run_dir: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "heldout"]
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    if train and "reward" in train[0]:
        ax.plot(steps, [r["reward"] for r in train], label="train reward", alpha=0.6)
        ax.plot(steps, [r["accuracy"] for r in train], label="train accuracy", alpha=0.6)
    if held:
        ax.plot([r["step"] for r in held], [r["accuracy"] for r in held], "o-", label="held-out accuracy (greedy)")
    if train and "teacher_gap" in train[0]:
        ax.plot(steps, [r["teacher_gap"] for r in train], label="teacher - student log-prob / token")
    ax.set_title("reward and accuracy")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    if train and "mean_length" in train[0]:
        ax.plot(steps, [r["mean_length"] for r in train], label="train T(y)", alpha=0.6)
    if held:
        ax.plot([r["step"] for r in held], [r["mean_length"] for r in held], "o-", label="held-out T(y)")
        ax.plot([r["step"] for r in held], [r["within_budget"] for r in held], "s--", label="held-out within budget")
    ax.set_title("length (tokens) and share within budget")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for key in ("clip_fraction", "staleness", "behaviour_kl", "kl"):
        if train and key in train[0]:
            ax.plot(steps, [r[key] for r in train], label=key)
    ax.set_title("policy movement")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    if train:
        ax.plot(steps, [r["loss"] for r in train], label="loss")
        if "entropy" in train[0]:
            ax.plot(steps, [r["entropy"] for r in train], label="entropy")
    ax.set_title("objective")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("iteration")
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(run_dir / PLOT_FILE, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


def write_rl_report(run_dir: Path, *, settings: dict, params: dict, records: list[dict], wall_time_s: float,
                    checkpoint: Path | None, tau: float, title: str = "k3 RL run") -> None:
    train = [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "heldout"]
    first, last = (held[0], held[-1]) if held else (None, None)
    lines = [f"# {title}: {run_dir.name}", "", "| | |", "|---|---|",
             f"| init | `{settings['init']}` ({params['total'] / 1e6:.2f}M parameters) |",
             f"| domain / effort | {settings['domain']} / {settings['effort']} (tau {tau:g}) |",
             (f"| iterations | {train[-1]['step'] if train else 0} x {settings.get('prompts')} prompts x "
              f"{settings.get('samples')} samples |")]
    if first is not None:
        lines += [(f"| held-out accuracy | {first['accuracy']:.1%} (step {first['step']}) -> "
                   f"{last['accuracy']:.1%} (step {last['step']}), {last['episodes']} prompts, greedy |"),
                  f"| held-out mean T(y) | {first['mean_length']:.1f} -> {last['mean_length']:.1f} tokens |",
                  f"| held-out within budget | {first['within_budget']:.1%} -> {last['within_budget']:.1%} |"]
    sampled = next((r for r in records if r["kind"] == "init_sampled"), None)
    if sampled is not None:  # the budget episodes: what RL can turn into greedy accuracy
        lines.append(f"| init model, held-out, sampled | pass@{sampled['k']} {sampled['pass_at_k']:.1%}, "
                     f"accuracy {sampled['accuracy']:.1%} ({sampled['prompts']} prompts) |")
    lines += [f"| wall time | {wall_time_s / 60:.1f} min |", f"| checkpoint | `{checkpoint}` |", "",
              f"![curves]({PLOT_FILE})", "", "## Settings", "", "```json", json.dumps(settings, indent=2), "```", ""]
    samples = [r for r in records if r["kind"] == "sample"]
    if samples:
        last_step = samples[-1]["step"]
        lines += [f"## Held-out replies (step {last_step})", ""]
        for s in (s for s in samples if s["step"] == last_step):
            lines += ["```text", s["prompt"] + s["text"], "```", ""]
    write_text_atomic(run_dir / REPORT_FILE, "\n".join(lines))


def write_distill_report(run_dir: Path, *, settings: dict, params: dict, records: list[dict], wall_time_s: float,
                         checkpoint: Path | None, teachers: list[tuple[str, float | None, float | None]]) -> None:
    """report.md of a MOPD run: per expert, the teacher's held-out accuracy and length beside the student's."""
    train = [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "heldout"]
    lines = [f"# k3 distillation run: {run_dir.name}", "", "| | |", "|---|---|",
             f"| student init | `{settings['init']}` ({params['total'] / 1e6:.2f}M parameters) |",
             (f"| iterations | {train[-1]['step'] if train else 0} x {settings['prompts']} prompts per teacher x "
              f"{settings['samples']} samples |"),
             f"| wall time | {wall_time_s / 60:.1f} min |", f"| checkpoint | `{checkpoint}` |", ""]
    if held:
        first, last = held[0], held[-1]
        lines += ["## Held-out, greedy, per expert", "",
                  ("| expert | teacher accuracy | student before | student after | gap | teacher length | "
                   "student length | student within budget |"), "|---|---|---|---|---|---|---|---|"]
        for name, acc, length in teachers:
            a, b = first["experts"][name], last["experts"][name]
            gap = f"{(b['accuracy'] - acc) * 100:+.1f} pts" if acc is not None else "-"
            lines.append(f"| {name} | {acc:.1%} | {a['accuracy']:.1%} | {b['accuracy']:.1%} | {gap} | "
                         f"{length:.1f} | {b['mean_length']:.1f} | {b['within_budget']:.1%} |"
                         if acc is not None else
                         f"| {name} | - | {a['accuracy']:.1%} | {b['accuracy']:.1%} | - | - | {b['mean_length']:.1f} | "
                         f"{b['within_budget']:.1%} |")
        lines.append("")
    lines += [f"![curves]({PLOT_FILE})", "", "## Settings", "", "```json", json.dumps(settings, indent=2), "```", ""]
    write_text_atomic(run_dir / REPORT_FILE, "\n".join(lines))
