"""The replicas behind the router: which are up (health checks), what they serve, restarts, and
`--spawn`: starting N `k3 serve` processes on loopback ports.

A replica is up once GET /v1/models answers with a k3 model list (the same model as the others) and
GET /health with 200; it goes down when a check or a forwarded request fails, and comes back at the
first check that passes again. A new `created` in its model list means a restarted process (its
prefix cache is empty: its sessions re-prefill there, as they did on their secondary).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 2.0  # seconds: a replica slower than this to answer a check is down


class NotAK3Server(ValueError):
    """Something answers at the URL, but not a k3 server (or not the fleet's model)."""


@dataclass
class Replica:
    url: str
    up: bool = False
    model: str | None = None
    created: int | None = None  # /v1/models `created` of the process last seen
    restarts: int = 0
    last_error: str = "not checked yet"
    command: list[str] | None = None  # how it was spawned (None: started by someone else)
    process: subprocess.Popen | None = None
    respawn_at: float = 0.0


def check_url(url: str) -> str:
    """A replica URL as given (http(s)://host:port), without a trailing slash; ValueError in one line."""
    parsed = httpx.URL(url) if "://" in url else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host or parsed.path not in ("", "/"):
        raise ValueError(f"replica {url!r} is not a URL like http://127.0.0.1:8000")
    return url.rstrip("/")


async def identify(client: httpx.AsyncClient, url: str) -> dict:
    """The model entry a k3 server lists. httpx.HTTPError when nothing answers (or it is unhealthy);
    NotAK3Server when something else does."""
    r = await client.get(f"{url}/v1/models", timeout=PROBE_TIMEOUT)
    if r.status_code == 401:
        raise NotAK3Server(f"{url} refuses the router's key (GET /v1/models: 401); pass --replica-api-key")
    try:
        entry = r.json()["data"][0]
        is_k3 = r.status_code == 200 and entry.get("owned_by") == "k3" and isinstance(entry.get("id"), str)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        is_k3 = False
    if not is_k3:
        raise NotAK3Server(f"{url} is not a k3 server (GET /v1/models: HTTP {r.status_code}, not a k3 model list)")
    health = await client.get(f"{url}/health", timeout=PROBE_TIMEOUT)
    if health.status_code != 200:
        raise httpx.HTTPStatusError(f"/health answered {health.status_code}", request=health.request, response=health)
    return entry


class ReplicaSet:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, on_down: Callable[[str], None] = lambda url: None):
        self.replicas = {url: Replica(url) for url in urls}
        self.client, self.on_down = client, on_down
        self.model: str | None = None  # the fleet's model id (the first replica identified)

    def __getitem__(self, url: str) -> Replica:
        return self.replicas[url]

    def alive(self) -> list[str]:
        return [url for url, r in self.replicas.items() if r.up]

    def mark_down(self, url: str, reason: str) -> None:
        r = self.replicas[url]
        r.last_error = reason
        if r.up:
            r.up = False
            log.warning("replica %s is down: %s", url, reason)
            self.on_down(url)

    async def check(self, url: str) -> None:
        """One health check; raises NotAK3Server for a URL that is not a k3 server of the fleet's model."""
        r = self.replicas[url]
        try:
            entry = await identify(self.client, url)
        except httpx.HTTPError as e:
            return self.mark_down(url, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if self.model is None:
            self.model = entry["id"]
        if entry["id"] != self.model:
            raise NotAK3Server(f"{url} serves model {entry['id']!r}, the other replicas {self.model!r}")
        if r.created is not None and entry.get("created") != r.created:
            r.restarts += 1
        r.model, r.created = entry["id"], entry.get("created")
        if not r.up:
            r.up, r.last_error = True, ""
            log.info("replica %s is up (%s)%s", url, r.model, " after a restart" if r.restarts else "")

    async def check_all(self) -> None:
        results = await asyncio.gather(*(self.check(url) for url in self.replicas), return_exceptions=True)
        for url, result in zip(self.replicas, results):
            if isinstance(result, NotAK3Server):
                self.mark_down(url, str(result))
            elif isinstance(result, BaseException):
                raise result

    async def watch(self, interval: float) -> None:
        """Health checks every `interval` seconds; a spawned replica that exited is started again."""
        while True:
            self.respawn_exited()
            await self.check_all()
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ spawned replicas
    def respawn_exited(self) -> None:
        now = time.monotonic()
        for url, r in self.replicas.items():
            if r.process is None or r.process.poll() is None:
                continue
            self.mark_down(url, f"process exited with code {r.process.returncode}")
            if now >= r.respawn_at:
                log.warning("replica %s exited (code %s): starting it again", url, r.process.returncode)
                r.process = subprocess.Popen(r.command, stdout=subprocess.DEVNULL)
                r.respawn_at = now + 10.0  # a replica that dies at start is not restarted in a tight loop

    def stop_spawned(self, grace: float = 10.0) -> None:
        procs = [r.process for r in self.replicas.values() if r.process is not None and r.process.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_command(serve_args: list[str], port: int, threads: int, host: str = "127.0.0.1") -> list[str]:
    """`k3 serve` for one spawned replica: its own process, port and CPU threads."""
    return [sys.executable, "-m", "k3", "--threads", str(threads), "serve", *serve_args, "--host", host,
            "--port", str(port)]


def spawn(replicas: ReplicaSet, commands: dict[str, list[str]]) -> None:
    for url, command in commands.items():
        r = replicas[url]
        # stdout carries the replicas' access log; their warnings and errors come on stderr
        r.command, r.process = command, subprocess.Popen(command, stdout=subprocess.DEVNULL)
