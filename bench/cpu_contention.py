"""Does k3 keep its speed on a CPU shared with one busy process? (k3/threads.py's thread rule)

    python -m bench.cpu_contention [--steps 8] [--reply-tokens 256] [--threads N]
    python -m bench.cpu_contention --sweep        # every thread count x wait policy, then k3's default

In one run: the default `k3 train` (k3-tiny, bundled corpus) for `--steps` steps alone, then beside
one busy competing process (`python -c "while True: pass"`); the same for one greedy reply of
`--reply-tokens` tokens from `k3 serve` (serving the first training run's checkpoint on a free
loopback port), timed as an HTTP client sees it. Training runs and the server are `k3`
subprocesses, so they pick their threads exactly as `k3` does (pass `--threads` to try another
count; `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment reach them too). Training time is
the mean of the steps after the first (which warms up allocators); a reply time is the median of
three, after one short warm-up reply. The table comes last: quiet, contended, their ratio, and
whether the ratio is within the bar (<= 2x). `--sweep` measures quiet and contended for each setting
of SWEEP (thread counts x OpenMP wait policies, through the environment), then k3's default, and
prints how far the default's quiet time is from the fastest setting (bar: within 10%).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BAR = 2.0
QUIET_BAR = 1.10  # k3's default, alone, against the fastest setting of the sweep
BUSY = "while True: pass"
# thread count x wait policy: sleeping threads, a short spin (GOMP_SPINCOUNT iterations), spinning
SWEEP = [(threads, policy) for threads in ("1", "2")
         for policy in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "ACTIVE"})]
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _busy():
    return subprocess.Popen([sys.executable, "-c", BUSY])


def _env(policy: dict | None) -> dict:
    """This process's environment with `policy` as the only wait setting (None: k3 chooses)."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS}
    return env if policy is None else {**env, **policy}


def train_seconds_per_step(steps: int, threads: str | None, out: Path, policy: dict | None = None) -> float:
    cmd = [sys.executable, "-m", "k3", *(["--threads", threads] if threads else []), "train", "--steps", str(steps),
           "--out", str(out), "--no-progress", "--eval-every", str(steps + 1), "--ckpt-every", str(steps + 1),
           "--eval-windows", "1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_env(policy))
    if proc.returncode != 0:
        sys.exit(f"bench.cpu_contention: `{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["tokens"] / r["step"] / r["tok_per_s"] for r in train[1:]] or [train[0]["elapsed"]]
    return sum(times) / len(times)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


class Server:
    """`k3 serve --run RUN` on a free loopback port (it picks its threads as `k3` does)."""

    def __init__(self, run: Path, threads: str | None, policy: dict | None = None):
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "k3", *(["--threads", threads] if threads else []), "serve", "--run", str(run),
               "--port", port, "--log-level", "warning"]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the server) a file, not a pipe: an unread pipe can fill and block
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, env=_env(policy))
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                sys.exit(f"bench.cpu_contention: `{' '.join(cmd)}` exited:\n{self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    sys.exit("bench.cpu_contention: the server did not answer /health within 120 s")
                time.sleep(0.25)
        self.model = json.loads(urllib.request.urlopen(self.url + "/v1/models").read())["data"][0]["id"]

    def reply_seconds(self, tokens: int) -> float:
        """One greedy /v1/completions reply of exactly `tokens` tokens, timed as the client sees it."""
        body = {"model": self.model, "prompt": "To be, or not to be", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.perf_counter()
        reply = _post(self.url + "/v1/completions", body)
        elapsed = time.perf_counter() - start
        assert reply["usage"]["completion_tokens"] == tokens, reply["usage"]
        return elapsed

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _measure(fn):
    quiet = fn()
    busy = _busy()
    try:
        time.sleep(0.5)  # let the competitor get scheduled
        contended = fn()
    finally:
        busy.kill()
        busy.wait()
    return quiet, contended


def measure(args, tmp: Path, threads: str | None, policy: dict | None, name: str):
    """(train quiet, contended), (reply quiet, contended) for one setting."""
    train = _measure(lambda: train_seconds_per_step(args.steps, threads, tmp / f"{name}-q{time.monotonic_ns()}",
                                                    policy))
    run = next(tmp.glob(f"{name}-q*"))
    server = Server(run, threads, policy)  # serves this setting's first training run
    try:
        server.reply_seconds(8)  # warm-up
        reply = _measure(lambda: statistics.median(server.reply_seconds(args.reply_tokens) for _ in range(3)))
    finally:
        server.close()
    return train, reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per measurement (default 8)")
    ap.add_argument("--reply-tokens", type=int, default=256, help="tokens in the timed reply (default 256)")
    ap.add_argument("--threads", help="passed to `k3 --threads` (default: k3's own choice)")
    ap.add_argument("--sweep", action="store_true", help="every setting of SWEEP, then k3's default")
    args = ap.parse_args()
    settings = [(t, p, f"{t} thread{'s' if t != '1' else ''}, {' '.join(f'{k}={v}' for k, v in p.items())}")
                for t, p in SWEEP] if args.sweep else []
    settings.append((args.threads, None, f"threads: {args.threads or 'k3 default'}"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (threads, policy, name) in enumerate(settings):
            results[name] = measure(args, Path(tmp), threads, policy, f"s{i}")
            print(f"{name}: train {results[name][0]}, reply {results[name][1]}", flush=True)
    print(f"\ncompetitor: one `python -c \"{BUSY}\"`; train: s/step over {args.steps} steps; "
          f"reply: s for {args.reply_tokens} greedy tokens")
    print(f"{'setting':48} {'train quiet':>11} {'busy':>6} {'ratio':>6} {'reply quiet':>11} {'busy':>6} {'ratio':>6}")
    for name, (train, reply) in results.items():
        cells = "".join(f" {q:11.2f} {c:6.2f} {c / q:5.2f}{'' if c / q <= BAR else '!'}" for q, c in (train, reply))
        print(f"{name:48}{cells}")
    if args.sweep:
        default = results[settings[-1][2]]
        for i, what in enumerate(("train", "reply")):
            best = min(results.values(), key=lambda r: r[i][0])[i][0]
            ratio = default[i][0] / best
            print(f"default's quiet {what} / fastest: {ratio:.2f} (bar <= {QUIET_BAR:.2f}: "
                  f"{'ok' if ratio <= QUIET_BAR else 'OVER'})")

if __name__ == "__main__":
    main()
