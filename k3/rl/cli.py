"""`k3 rl`: train one RL expert (a domain at an effort level) from an SFT run, with partial rollout
and effort budgets. `max` starts from the SFT model; `high` and `low` start from the expert one
level up (`--run runs/rl-<domain>-max-...`) and reuse its budgets.json, so b0(x) is the same."""
from __future__ import annotations

import argparse
import dataclasses
import json

from k3.checkpoint.training_state import ResumeStateError
from k3.rl.effort import EFFORTS
from k3.rl.trainer import RLSettings, RLTrainer
from k3.tasks.domains import DOMAIN_CLASSES
from k3.train.cli import train_verb
from k3.train.settings import add_settings_arguments, given_settings
from k3.train.trainer import TrainError

_DEFAULTS = RLSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add_settings_arguments(p, RLSettings, resume="RL_RUN_DIR")
    p.add_argument("--domain", choices=list(DOMAIN_CLASSES), help=f"task domain (default {d.domain})")
    p.add_argument("--domain-options", help='JSON of the domain\'s options, e.g. \'{"max_level": 16, "tail": 1.5}\'')
    p.add_argument("--effort", choices=list(EFFORTS), help=f"effort level (default {d.effort})")
    p.add_argument("--tau", type=float, help="budget multiple: reward -1 beyond tau * b0(x) "
                                             "(default: max 2, high 1, low 0.5)")
    p.add_argument("--budgets", help="budgets.json to use (default: the init run's when it trained the same domain, "
                                     "else measured from the init model's samples)")
    p.add_argument("--budget-samples", type=int, help=f"init-model samples per prompt for b0 (default {d.budget_samples})")
    p.add_argument("--kl-coef", type=float, help=f"per-token k3 KL to the init model (default {d.kl_coef})")
    p.add_argument("--normalize-std", action="store_true", default=None, help="divide advantages by the group std")
    p.add_argument("--filter-groups", action="store_true", default=None,
                   help="train only episodes whose advantage is nonzero (drop groups of equal rewards)")
    p.add_argument("--sandboxes", type=int, help=f"shell domain: warm sandboxes in the pool (default {d.sandboxes})")
    p.add_argument("--sandbox-memory-mb", type=int,
                   help=f"shell domain: each sandbox's memory, all its processes together (default {d.sandbox_memory_mb})")


def settings_from(args, defaults, cls):
    changes = given_settings(args, cls)
    if isinstance(changes.get("domain_options"), str):
        try:
            options = json.loads(changes["domain_options"])
        except json.JSONDecodeError as e:
            raise TrainError(f"--domain-options is not JSON: {e}") from None
        if not isinstance(options, dict):
            raise TrainError("--domain-options must be a JSON object")
        changes["domain_options"] = options
    if not changes.get("init"):
        raise TrainError("say where to start: --run RUN_DIR or --model CHECKPOINT_DIR")
    return dataclasses.replace(defaults, **changes)


def run_verb(verb: str, args, trainer_class, defaults, settings_class):
    """`train_verb` for `k3 rl` and `k3 distill`: (trainer, result, held-out records), or an exit code."""
    done = train_verb(verb, args, trainer_class, lambda a: settings_from(a, defaults, settings_class),
                      (TrainError, ResumeStateError))
    if isinstance(done, int):
        return done
    trainer, result = done
    return trainer, result, [r for r in trainer.metrics.read() if r["kind"] == "heldout"]


def run(args) -> int:
    done = run_verb("rl", args, RLTrainer, _DEFAULTS, RLSettings)
    if isinstance(done, int):
        return done
    trainer, result, held = done
    if trainer.world.is_main and held:
        first, last = held[0], held[-1]
        print(f"\nRL run saved to {result['run_dir']}\n"
              f"  held-out accuracy {first['accuracy']:.1%} -> {last['accuracy']:.1%} ({last['episodes']} prompts, "
              f"greedy), mean length {last['mean_length']:.1f}, within budget {last['within_budget']:.1%}, "
              f"{result['elapsed'] / 60:.1f} min\n"
              f"  checkpoint {result['checkpoint']}\n  report {result['run_dir']}/report.md")
    return 0
