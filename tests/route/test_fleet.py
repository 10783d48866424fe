"""`k3 route --spawn 3` over real k3-tiny replicas (slow: three model processes): sessions stay put,
a SIGKILLed replica costs no request, and its restarted process is taken back."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from bench.common import random_tiny_run
from k3.route.replicas import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return random_tiny_run(tmp_path_factory.mktemp("run"))


def test_spawned_fleet_survives_a_sigkill(run_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "k3", "--threads", "1", "route", "--spawn", "3", "--run",
                             str(run_dir), "--port", str(port), "--health-interval", "0.5", "--log-level", "warning"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def ask(session: str) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": f"hi {session}"}], "max_tokens": 2,
                    "temperature": 0, "user": session}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)

        first = {s: ask(s) for s in map(str, range(9))}
        assert all(r.status_code == 200 for r in first.values()), [r.text for r in first.values()]
        homes = {s: r.headers["x-k3-replica"] for s, r in first.items()}
        assert all(ask(s).headers["x-k3-replica"] == home for s, home in homes.items())
        victim = max(set(homes.values()), key=list(homes.values()).count)
        pid = int(subprocess.check_output(["lsof", "-t", f"-iTCP:{victim.rsplit(':', 1)[1]}", "-sTCP:LISTEN"]))
        os.kill(pid, signal.SIGKILL)
        for s, home in homes.items():
            r = ask(s)
            assert r.status_code == 200, r.text
            assert (r.headers["x-k3-replica"] != victim) or home != victim
        deadline = time.monotonic() + 120  # the router starts its spawned replica again
        while httpx.get(url + "/health").json()["replicas"][victim] != "up":
            assert time.monotonic() < deadline, "the killed replica was not taken back"
            time.sleep(0.5)
        assert all(ask(s).headers["x-k3-replica"] == home for s, home in homes.items() if home == victim)
        assert 'k3_route_replica_restarts_total' in httpx.get(url + "/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
