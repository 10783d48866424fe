"""Does k3 keep its speed on a CPU shared with one busy process? (k3/threads.py's thread rule)

    python -m bench.cpu_contention [--steps 8] [--reply-tokens 256] [--threads N]

In one run: the default `k3 train` (k3-tiny, bundled corpus) for `--steps` steps alone, then beside
one busy competing process (`python -c "while True: pass"`); the same for one greedy reply of
`--reply-tokens` tokens from `k3 serve` (serving the first training run's checkpoint on a free
loopback port), timed as an HTTP client sees it. Training runs and the server are `k3`
subprocesses, so they pick their threads exactly as `k3` does (pass `--threads` to try another
count; `OMP_WAIT_POLICY` / `GOMP_SPINCOUNT` in the environment reach them too). Training time is
the mean of the steps after the first (which warms up allocators); the replies follow one short
warm-up reply. The table comes last: quiet, contended, their ratio, and
whether the ratio is within the bar (<= 2x).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BAR = 2.0
BUSY = "while True: pass"


def _busy():
    return subprocess.Popen([sys.executable, "-c", BUSY])


def train_seconds_per_step(steps: int, threads: str | None, out: Path) -> float:
    cmd = [sys.executable, "-m", "k3", *(["--threads", threads] if threads else []), "train", "--steps", str(steps),
           "--out", str(out), "--no-progress", "--eval-every", str(steps + 1), "--ckpt-every", str(steps + 1),
           "--eval-windows", "1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
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

    def __init__(self, run: Path, threads: str | None):
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "k3", *(["--threads", threads] if threads else []), "serve", "--run", str(run),
               "--port", port, "--log-level", "warning"]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed with the server) a file, not a pipe: an unread pipe can fill and block
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per measurement (default 8)")
    ap.add_argument("--reply-tokens", type=int, default=256, help="tokens in the timed reply (default 256)")
    ap.add_argument("--threads", help="passed to `k3 --threads` (default: k3's own choice)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1_000))
        train = _measure(lambda: train_seconds_per_step(args.steps, args.threads, Path(tmp) / f"run{next(runs)}"))
        server = Server(Path(tmp) / "run0", args.threads)  # serves the first training run's checkpoint
        try:
            server.reply_seconds(8)  # warm-up
            reply = _measure(lambda: server.reply_seconds(args.reply_tokens))
        finally:
            server.close()
    rows = [(f"k3 train, s/step ({args.steps} steps)", *train), (f"{args.reply_tokens}-token k3 serve reply, s", *reply)]
    print(f"\nthreads: {args.threads or 'k3 default'}; competitor: one `python -c \"{BUSY}\"`")
    print(f"{'':32} {'quiet':>8} {'contended':>10} {'ratio':>6}  bar (<= {BAR:g}x)")
    for name, quiet, contended in rows:
        ratio = contended / quiet
        print(f"{name:32} {quiet:8.2f} {contended:10.2f} {ratio:6.2f}  {'ok' if ratio <= BAR else 'OVER'}")


if __name__ == "__main__":
    main()
