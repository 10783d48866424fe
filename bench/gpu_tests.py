"""The pytest files that need CUDA (skipped on every CPU machine, CI included), run on the GPU as a
section of bench/gpu_run.py (`--sections tests:gpu`), so they share its Triton cache and time budget.

Each test's outcome is recorded as it finishes (a check named `pytest <node id>`, status PASS /
FAIL / ERROR / SKIP): fla's kernels compile and autotune cold for minutes, and a run stopped at its
deadline keeps what finished and records the tests it did not reach as SKIP, "not reached".

    python3 bench/gpu_tests.py            # alone, without a deadline
"""
from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_TEST_FILES = ["tests/test_decode_graph.py", "tests/test_kda_fla.py"]
# the project's addopts (-q, -m 'not slow') replaced: one line per test, slow ones included
PYTEST = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:randomly"]
OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)")
STATUS = {"PASSED": "PASS", "FAILED": "FAIL", "ERROR": "ERROR", "SKIPPED": "SKIP"}


def collect(files: list[str]) -> list[str]:
    out = subprocess.run(PYTEST + ["--collect-only", "-q", *files], cwd=REPO, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "::" in line]


def run_tests(record: Callable[[dict], None], deadline: float, files: list[str] = GPU_TEST_FILES) -> None:
    """Runs `files` under pytest until `deadline` (time.monotonic()), one record per test."""
    pending = collect(files)
    proc = subprocess.Popen(PYTEST + ["-v", "-rN", *files], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()  # read on a thread: a cold compile prints nothing for minutes

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    failures: list[str] = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            print(line, end="", flush=True)  # the section's log keeps pytest's own output
            if (m := OUTCOME.match(line)) is not None:
                node, outcome = m.groups()
                record({"kind": "check", "name": f"pytest {node}", "status": STATUS[outcome]})
                if node in pending:
                    pending.remove(node)
                failures += [node] if outcome in ("FAILED", "ERROR") else []
    finally:
        proc.kill()
        proc.wait()
    for node in pending:
        record({"kind": "check", "name": f"pytest {node}", "status": "SKIP",
                "note": "not reached before the deadline"})
    if failures:
        print(f"failed: {failures}; the assertion messages are above", flush=True)


if __name__ == "__main__":
    run_tests(lambda entry: None, deadline=float("inf"))
