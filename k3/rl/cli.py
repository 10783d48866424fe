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
from k3.train.cli import add_optimizer_arguments, add_run_arguments, train_verb
from k3.train.trainer import TrainError

_DEFAULTS = RLSettings()


def add_rl_arguments(p: argparse.ArgumentParser, d) -> None:
    """The rollout and objective flags `k3 rl` and `k3 distill` share."""
    p.add_argument("--out", help="run folder (default runs/<verb>-...-<timestamp>)")
    p.add_argument("--steps", type=int, help=f"iterations, one optimizer step each (default {d.steps})")
    p.add_argument("--prompts", type=int, help=f"new prompts per iteration, N (default {d.prompts})")
    p.add_argument("--samples", type=int, help=f"completions per prompt, K (default {d.samples})")
    p.add_argument("--stop-fraction", type=float,
                   help=f"partial rollout: pause once this share of N*K has finished; the rest resume next "
                        f"iteration (default {d.stop_fraction}: synchronous)")
    p.add_argument("--temperature", type=float, help=f"rollout sampling temperature (default {d.temperature})")
    p.add_argument("--max-tokens", type=int, help=f"tokens per assistant turn (default {d.max_tokens})")
    p.add_argument("--heldout", type=int, help=f"held-out prompts evaluated greedily (default {d.heldout})")
    p.add_argument("--eps-low", type=float, help=f"ratio clip floor 1 - eps (default {d.eps_low})")
    p.add_argument("--eps-high", type=float, help=f"ratio clip ceiling 1 + eps (default {d.eps_high})")
    p.add_argument("--min-lr-ratio", type=float, help=f"(default {d.min_lr_ratio}: constant after warmup)")
    add_optimizer_arguments(p, d)
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="rollouts and trainer in batch-invariant arithmetic (CPU, slower): recorded log-probs "
                        "equal the trainer's bit for bit, QAT included")
    p.add_argument("--no-share-prompts", dest="share_prompts", action="store_false", default=None,
                   help="pack every trajectory whole in the trainer's forward instead of running each distinct "
                        "prompt once (same loss; K times the prompt tokens)")
    p.add_argument("--eval-every", type=int, help=f"iterations between held-out evals (default {d.eval_every})")
    add_run_arguments(p, d)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    start = p.add_mutually_exclusive_group()
    start.add_argument("--run", dest="init_run", metavar="RUN_DIR",
                       help="start from this run's latest checkpoint (a `k3 sft` run, or the expert one effort up)")
    start.add_argument("--model", dest="init_model", metavar="CHECKPOINT_DIR", help="start from this checkpoint folder")
    start.add_argument("--resume", metavar="RL_RUN_DIR", help="continue an RL run from its latest checkpoint")
    p.add_argument("--domain", choices=list(DOMAIN_CLASSES), help=f"task domain (default {d.domain})")
    p.add_argument("--domain-options", help='JSON of the domain\'s options, e.g. \'{"max_level": 16, "tail": 1.5}\'')
    p.add_argument("--effort", choices=list(EFFORTS), help=f"effort level (default {d.effort})")
    p.add_argument("--tau", type=float, help="budget multiple: reward -1 beyond tau * b0(x) "
                                             "(default: max 2, high 1, low 0.5)")
    p.add_argument("--budgets", help="budgets.json to use (default: the init run's when it trained the same domain, "
                                     "else measured from the init model's samples)")
    p.add_argument("--pool", type=int, help=f"training prompts, cycled (default {d.pool})")
    p.add_argument("--budget-samples", type=int, help=f"init-model samples per prompt for b0 (default {d.budget_samples})")
    p.add_argument("--kl-coef", type=float, help=f"per-token k3 KL to the init model (default {d.kl_coef})")
    p.add_argument("--normalize-std", action="store_true", default=None, help="divide advantages by the group std")
    p.add_argument("--filter-groups", action="store_true", default=None,
                   help="train only episodes whose advantage is nonzero (drop groups of equal rewards)")
    add_rl_arguments(p, d)


def settings_from(args, defaults, cls):
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
               if getattr(args, f.name, None) is not None}
    if isinstance(changes.get("domain_options"), str):
        try:
            options = json.loads(changes["domain_options"])
        except json.JSONDecodeError as e:
            raise TrainError(f"--domain-options is not JSON: {e}") from None
        if not isinstance(options, dict):
            raise TrainError("--domain-options must be a JSON object")
        changes["domain_options"] = options
    init = args.init_run or args.init_model
    if not init:
        raise TrainError("say where to start: --run RUN_DIR or --model CHECKPOINT_DIR")
    return dataclasses.replace(defaults, **changes, init=init)


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
