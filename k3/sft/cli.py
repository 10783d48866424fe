"""`k3 sft`: supervised fine-tuning in K3's XTML chat format, from a `k3 train` run or a checkpoint.

With only `--run RUN_DIR`, trains on the embedded default SFT set (tool use, short reasoning, plain
answers) and scores held-out agent episodes at the end. Every default lives in SFTSettings; flags
left out keep it. Distributed exactly like `k3 train` (torchrun, FSDP2).
"""
from __future__ import annotations

import argparse
import dataclasses

from k3.checkpoint.training_state import ResumeStateError
from k3.sft.trainer import SFTSettings, SFTTrainer
from k3.tasks.conversations import SFTDataError
from k3.train.cli import train_verb
from k3.train.settings import add_settings_arguments, given_settings
from k3.train.trainer import TrainError

_DEFAULTS = SFTSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    data = add_settings_arguments(p, SFTSettings, resume="SFT_RUN_DIR")["data"]
    data.add_argument("--val-data", help="held-out JSONL (default: every k-th conversation of --data, k = 1/--val-fraction)")
    data.add_argument("--train-size", type=int, help=f"default set: train conversations (default {d.train_size})")
    data.add_argument("--val-size", type=int, help=f"default set: held-out conversations (default {d.val_size})")
    p.add_argument("--no-share-prefixes", dest="share_prefixes", action="store_false", default=None,
                   help="run every conversation whole instead of running the tokens before each one's first "
                        "assistant target once per distinct prefix (same loss)")
    p.add_argument("--agent-episodes", type=int, help=f"held-out agent episodes scored at the end (default {d.agent_episodes})")
    p.add_argument("--max-reply-tokens", type=int, help=f"tokens per generated reply (default {d.max_reply_tokens})")


def _settings(args) -> SFTSettings:
    changes = given_settings(args, SFTSettings)
    if not changes.get("init"):
        raise TrainError("say where to start: --run RUN_DIR (a `k3 train` run) or --model CHECKPOINT_DIR")
    # flags that the other data source would silently ignore
    if args.data is None and args.val_data is not None:
        raise TrainError("--val-data goes with --data (the default set has its own held-out split)")
    if args.data is not None and (args.train_size is not None or args.val_size is not None):
        raise TrainError("--train-size and --val-size size the default set; with --data every conversation is used")
    return dataclasses.replace(_DEFAULTS, **changes)


def run(args) -> int:
    done = train_verb("sft", args, SFTTrainer, _settings, (TrainError, SFTDataError, ResumeStateError))
    if isinstance(done, int):
        return done
    trainer, result = done
    if trainer.world.is_main:
        run_dir = result["run_dir"]
        lines = [f"\nSFT run saved to {run_dir}",
                 (f"  held-out assistant loss {result['val_loss']:.4f} nats/token ({result['val_tokens']:,} tokens), "
                  f"{result['elapsed'] / 60:.1f} min")]
        agent = result.get("agent")
        if agent:
            lines.append("  held-out agent episodes: " + ", ".join(
                f"{k.replace('_', ' ')} {v:.0%}" for k, v in agent.items() if isinstance(v, float)))
        lines += [f"  checkpoint {result['checkpoint']}",
                  f"  report {run_dir}/report.md, loss curve {run_dir}/loss.png",
                  f"  try: k3 chat --run {run_dir}   or   k3 serve --run {run_dir}"]
        print("\n".join(lines))
    return 0
