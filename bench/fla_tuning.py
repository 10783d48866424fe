"""Record fla's autotuning choices on the device and merge them into k3/ops/fla_tuning.json.

On the device (a Hopper card), with seeding off so that every key is tuned afresh:
  K3_FLA_AUTOTUNE=1 python -m bench.fla_tuning run DUMP.json -- train --device cuda   # any k3 verb
  K3_FLA_AUTOTUNE=1 python -m pytest -m gpu -p bench.fla_tuning --fla-record DUMP.json
Here, with the dumps fetched back:
  python -m bench.fla_tuning merge DUMP.json ...        # adds them to k3/ops/fla_tuning.json
A dump is rewritten after every test and at exit (also on SIGTERM from `timeout`), so a command
cut off at its limit still keeps what it tuned.
"""
from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
from pathlib import Path

from k3.ops import fla_tuning

_path: Path | None = None


def _write() -> None:
    if _path is not None and "fla" in sys.modules:
        fla_tuning.record(_path)


def start_recording(path: str | Path, *, exit_on_term: bool = True) -> None:
    """Record to `path` at exit; with `exit_on_term`, SIGTERM becomes an exit so the record is
    written (not under pytest, which would catch that exit inside a test and carry on)."""
    global _path
    _path = Path(path)
    atexit.register(_write)
    if exit_on_term:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# ---------------------------------------------------------------- pytest plugin (-p bench.fla_tuning)
def pytest_addoption(parser):
    parser.addoption("--fla-record", default=None, help="write fla's autotuning choices to this JSON file")


def pytest_configure(config):
    if config.getoption("--fla-record"):
        start_recording(config.getoption("--fla-record"), exit_on_term=False)


def pytest_runtest_logfinish(nodeid, location):
    _write()


# ---------------------------------------------------------------- merge
def merge(dumps: list[Path], into: Path = fla_tuning.TUNING_FILE) -> tuple[int, int]:
    """Add the dumps' entries to `into` (a later dump wins on the same kernel and key); returns
    (kernels, entries) of the merged file."""
    table = json.loads(into.read_text()) if into.is_file() else {}
    for dump in dumps:
        for name, entries in json.loads(dump.read_text()).items():
            by_key = {json.dumps(k): [k, c] for k, c in table.get(name, [])}
            by_key.update({json.dumps(k): [k, c] for k, c in entries})
            table[name] = [by_key[k] for k in sorted(by_key)]
    into.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return len(table), sum(len(v) for v in table.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fla_tuning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a k3 verb, recording fla's tuning choices")
    run.add_argument("dump")
    run.add_argument("k3_args", nargs=argparse.REMAINDER)
    m = sub.add_parser("merge", help="merge dumps into k3/ops/fla_tuning.json")
    m.add_argument("dumps", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "merge":
        kernels, entries = merge(args.dumps)
        print(f"{fla_tuning.TUNING_FILE}: {kernels} kernels, {entries} keys")
        return
    start_recording(args.dump)
    from k3.cli import main as k3_main

    k3_args = args.k3_args[1:] if args.k3_args[:1] == ["--"] else args.k3_args
    sys.exit(k3_main(k3_args))


if __name__ == "__main__":
    main()
