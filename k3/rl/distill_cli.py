"""`k3 distill`: merge RL experts into one student by multi-teacher on-policy distillation (MOPD)."""
from __future__ import annotations

import argparse

from k3.rl.cli import run_verb
from k3.rl.distill import DistillSettings, DistillTrainer
from k3.train.settings import add_settings_arguments

_DEFAULTS = DistillSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, DistillSettings, resume="DISTILL_RUN_DIR")
    p.add_argument("--teachers", nargs="+", metavar="RL_RUN_DIR",
                   help="`k3 rl` runs, one per (domain, effort); each scores the student's tokens on its own prompts")


def run(args) -> int:
    done = run_verb("distill", args, DistillTrainer, _DEFAULTS, DistillSettings)
    if isinstance(done, int):
        return done
    trainer, result, held = done
    if trainer.world.is_main and held:
        last = held[-1]
        lines = [f"\nDistillation run saved to {result['run_dir']} ({result['elapsed'] / 60:.1f} min)"]
        for t in trainer.teachers:
            e = last["experts"][t.name]
            teacher = f"{t.accuracy:.1%}" if t.accuracy is not None else "-"
            lines.append(f"  {t.name}: student {e['accuracy']:.1%} (teacher {teacher}), mean length {e['mean_length']:.1f}")
        lines += [f"  checkpoint {result['checkpoint']}", f"  report {result['run_dir']}/report.md"]
        print("\n".join(lines))
    return 0
