"""Cold-start SFT data for the RL domains: each task's prompt and its reference episode
(k3/tasks/domains.py) as OpenAI-style conversations, so the SFT model RL starts from has seen the
domains' formats (DESIGN §13.1: SFT precedes RL). Written as a JSONL for `k3 sft --data`:

    python -m k3.rl.cold_start data/cold.jsonl --domains arithmetic,strings,tool --size 200
    k3 sft --run runs/k3-tiny-<ts> --data data/cold.jsonl --steps 120

The episodes are drawn from the domains' training split (never a held-out problem, by the split),
at indices from COLD_START_OFFSET on, away from an RL run's pool indices 0..pool-1; small problem
spaces (one-digit arithmetic) still repeat some pool problems, which is fine for training prompts.
The embedded default SFT set's training conversations (tool use, plain answers) are mixed in.

The episodes take the effort levels of `--efforts` in turn (default max, high, low), each written
as that level's expert would (`Task.reference_at`): `max` keeps the reference trace, `high` thinks
the domain's brief trace (arithmetic: each step's result alone, "12. 36. 32."; strings: the result
with the scaffolding dropped; tool: the reference trace, already one sentence), `low` keeps the
answer and drops the think trace (what a low expert converges to under tau = 0.5). So the SFT model
has seen the effort message change how long it thinks before RL and MOPD rely on it. With one trace
for max and high, RL did not separate the two (docs/LOG.md "RL and distillation");
`--high-trace full` gives that older data.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from k3.rl.effort import EFFORTS
from k3.rl.effort import effort as effort_level
from k3.tasks import default_set
from k3.tasks.domains import make_domain

COLD_START_OFFSET = 1_000_000
DEFAULT_EFFORTS = tuple(EFFORTS)  # max, high, low: every level, in training order


def _names(text: str, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag} needs at least one name")
    return names


def parse_domains(text: str) -> list[str]:
    """'arithmetic,strings' -> ['arithmetic', 'strings'] (ValueError naming an unknown one)."""
    names = _names(text, "--domains")
    for n in names:
        make_domain(n)  # raises on an unknown name
    return names


def parse_efforts(text: str) -> list[str]:
    """'max,low' -> ['max', 'low'] (ValueError naming an unknown level)."""
    names = _names(text, "--efforts")
    for n in names:
        effort_level(n)  # raises on an unknown level
    return names


HIGH_TRACES = ("brief", "full")


def episode(task, effort: str = "max", high_trace: str = "brief") -> dict:
    """A task's reference episode as a conversation at `effort` (high: the brief trace unless
    high_trace is "full"; low: no think trace)."""
    if high_trace not in HIGH_TRACES:
        raise ValueError(f"high_trace must be one of {HIGH_TRACES}, got {high_trace!r}")
    as_level = "max" if effort == "high" and high_trace == "full" else effort
    out = {"messages": task.messages + task.reference_at(as_level)}
    if task.tools:
        out["tools"] = task.tools
    if effort != "max":  # max is the default effort message; leaving it out keeps old files byte-equal
        out["reasoning_effort"] = effort
    return out


def conversations(domains: Sequence[str], n: int, seed: int = 0, default_size: int = 0,
                  efforts: Sequence[str] = DEFAULT_EFFORTS, high_trace: str = "brief") -> list[dict]:
    """`n` reference episodes of each domain, interleaved domain by domain, the k-th of each domain
    at efforts[k % len(efforts)], then `default_size` conversations of the default SFT set's
    training split spread evenly among them."""
    per = [make_domain(name, seed).tasks("train", n, start=COLD_START_OFFSET) for name in domains]
    out = [episode(tasks[i], efforts[i % len(efforts)], high_trace) for i in range(n) for tasks in per]
    extra = default_set.conversations("train", default_size, seed)
    if extra:
        every = max(1, len(out) // len(extra))
        mixed = []
        for i, c in enumerate(out):
            mixed.append(c)
            if i % every == every - 1 and extra:
                mixed.append(extra.pop(0))
        out = mixed + extra
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3.rl.cold_start", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSONL to write (for `k3 sft --data`)")
    ap.add_argument("--domains", default="arithmetic,strings,tool")
    ap.add_argument("--size", type=int, default=200, help="reference episodes per domain (default 200)")
    ap.add_argument("--default-set", type=int, default=320,
                    help="conversations of the embedded default SFT set mixed in (default 320)")
    ap.add_argument("--efforts", default=",".join(DEFAULT_EFFORTS),
                    help="effort levels the episodes take in turn (default %(default)s; low: no trace)")
    ap.add_argument("--high-trace", choices=HIGH_TRACES, default="brief",
                    help="high-effort episodes think the domain's brief trace or the full one (default brief)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        domains = parse_domains(args.domains)
        efforts = parse_efforts(args.efforts)
        if args.size < 1 or args.default_set < 0:
            raise ValueError("--size must be >= 1 and --default-set >= 0")
    except ValueError as e:
        print(f"cold_start: error: {e}", file=sys.stderr)
        return 2
    convs = conversations(domains, args.size, args.seed, args.default_set, efforts, args.high_trace)
    default_set.write_jsonl(args.out, convs)
    print(f"wrote {len(convs)} conversations to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
