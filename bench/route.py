"""`k3 route` in front of 3 `k3 serve` replicas of k3-tiny on loopback (CPU): the prefix-cache hit
rate and time to first token per routing policy, failover under SIGKILL, budgeted admission.

    python -m bench.route [--run RUN] [--sessions 200 --turns 3] [--sglang-python PY]
                          [--phases policies,failover,admission]

policies: the same multi-turn workload (a completion prompt that grows by the reply and a new user
line each turn, every session a unique opening; each policy its own sessions, so no policy finds
another's prefixes) through `k3 route --policy affinity|round_robin|random`
and, with --sglang-python (a Python with `sglang-router` installed), through sglang-router's
`cache_aware` and `round_robin`. Hit rate: prompt tokens served from the replicas' prefix caches over
prompt tokens (their /metrics). failover: affinity; one replica SIGKILLed after a third of the
turns, restarted after two thirds (chat requests, whole replies); counts failed requests, where the killed replica's sessions went,
and whether they came back. admission: its own replicas of `--max-num-seqs 4`; short completions
arriving every 0.1 s alone, under a burst of 36 maximum-length prompts (3x the fleet's seats) with
the router's admission rules off, and with them on, in interleaved rounds, every prompt unique.
Without --run, a random-weight k3-tiny run is written to a temporary folder.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from k3.route.affinity import explicit_key
from k3.route.policy import Policy
from k3.route.replicas import free_port, serve_command

WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "lazy", "brown", "fox", "jumps", "over", "dog", "tell",
         "me", "about", "the", "weather", "city", "night", "light", "music", "paper", "window", "garden", "yellow",
         "ocean", "travel", "story", "number", "simple", "table"]


def tiny_run(folder: Path) -> Path:
    from bench.common import random_tiny_run  # torch only here: the router side of the bench runs without it

    return random_tiny_run(folder, [" ".join(WORDS)] * 4)


def wait_up(url: str, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not up after {timeout} s")


class Fleet:
    def __init__(self, run: Path, n: int, serve_args: list[str]):
        self.args = ["--run", str(run), "--log-level", "warning", *serve_args]
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs = [self._start(i) for i in range(n)]
        for url, proc in zip(self.urls, self.procs):
            wait_up(url, proc)

    def _start(self, i: int) -> subprocess.Popen:
        return subprocess.Popen(serve_command(self.args, self.ports[i], threads=1), stdout=subprocess.DEVNULL)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def restart(self, i: int) -> None:
        self.procs[i] = self._start(i)

    def counters(self) -> tuple[float, float]:
        hits = queries = 0.0
        for url in self.urls:
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            hits += _metric(text, "k3_prefix_cache_hits_total")
            queries += _metric(text, "k3_prefix_cache_queries_total")
        return hits, queries

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


class Router:
    """`k3 route` (policy in POLICIES) or sglang-router ("sglang:POLICY") as a subprocess."""

    def __init__(self, policy: str, urls: list[str], run: Path, sglang_python: str | None, extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if policy.startswith("sglang:"):
            cmd = [sglang_python, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy",
                   policy.split(":")[1], "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn"]
        else:
            cmd = [sys.executable, "-m", "k3", "--threads", "1", "route", "--replica", *urls, "--run", str(run),
                   "--policy", policy, "--port", str(self.port), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:  # both answer /v1/models once their workers are registered
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"router {policy} did not start")
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def opening(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat_turn(client: httpx.AsyncClient, url: str, messages: list, max_tokens: int, stream: bool,
                    session: str | None = None) -> dict:
    """One request; returns ttft, the replica header, the reply text and whether it failed."""
    body = {"model": "run", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    headers = {"x-session-id": session} if session else {}
    t0 = time.monotonic()
    out = {"ttft": None, "replica": None, "text": "", "failed": None}
    try:
        if not stream:
            r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
            out["ttft"], out["replica"] = time.monotonic() - t0, r.headers.get("x-k3-replica")
            if r.status_code != 200:
                out["failed"] = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                m = r.json()["choices"][0]["message"]
                out["text"] = (m.get("reasoning") or "") + (m.get("content") or "")
            return out
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            out["replica"] = r.headers.get("x-k3-replica")
            if r.status_code != 200:
                out["failed"] = f"HTTP {r.status_code}: {(await r.aread())[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["failed"] = f"error chunk: {event['error']}"
                    continue
                for c in event.get("choices") or ():
                    d = c.get("delta") or {}
                    piece = (d.get("reasoning") or "") + (d.get("content") or "")
                    if piece and out["ttft"] is None:
                        out["ttft"] = time.monotonic() - t0
                    out["text"] += piece
    except httpx.HTTPError as e:
        out["failed"] = f"{type(e).__name__}: {e}"
    return out


async def complete_turn(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion; returns ttft (to the first non-empty text: a token that is a byte of a
    character shows none), the replica header, the text and whether it failed."""
    body = {"model": "run", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    out = {"ttft": None, "replica": None, "text": "", "failed": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["replica"] = r.headers.get("x-k3-replica")
            if r.status_code != 200:
                out["failed"] = f"HTTP {r.status_code}"
                return out
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["failed"] = str(event["error"])
                    for c in event.get("choices") or ():
                        if c.get("text") and out["ttft"] is None:
                            out["ttft"] = time.monotonic() - t0
                        out["text"] += c.get("text") or ""
    except httpx.HTTPError as e:
        out["failed"] = f"{type(e).__name__}: {e}"
    return out


async def sessions_workload(url: str, n: int, turns: int, concurrency: int, seed: int, max_tokens: int,
                            stream: bool, on_turn=None, chat: bool = True, words: int = 40,
                            explicit: bool = False) -> list[dict]:
    """n sessions of `turns` turns each, `concurrency` sessions at a time; returns every request's result
    with its session and turn. chat=False: the transcript grows as one completion prompt."""
    rng = random.Random(seed)
    openings = [opening(rng, words) for _ in range(n)]
    results: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    done_turns = [0]

    async def session(i: int, client: httpx.AsyncClient):
        async with sem:
            messages = [{"role": "user", "content": f"session {seed}-{i}: {openings[i]}"}]
            prompt = f"session {seed}-{i}: {openings[i]}"
            for t in range(turns):
                if chat:
                    res = await chat_turn(client, url, messages, max_tokens, stream,
                                          f"s{seed}-{i}" if explicit else None)
                else:
                    res = await complete_turn(client, url, prompt, max_tokens)
                results.append({**res, "session": i, "turn": t})
                more = opening(rng, 12)
                messages = messages + [{"role": "assistant", "content": res["text"] or "ok"},
                                       {"role": "user", "content": more}]
                prompt += f"{res['text']}\n{more}\n"
                done_turns[0] += 1
                if on_turn is not None:
                    await on_turn(done_turns[0])

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(session(i, client) for i in range(n)))
    return results


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def phase_policies(fleet: Fleet, run: Path, args) -> list[str]:
    policies = ["affinity", "round_robin", "random"]
    if args.sglang_python:
        policies += ["sglang:cache_aware", "sglang:round_robin"]
    lines = []
    for k, policy in enumerate(policies):
        router = Router(policy, fleet.urls, run, args.sglang_python)
        h0, q0 = fleet.counters()
        t0 = time.monotonic()
        res = asyncio.run(sessions_workload(router.url, args.sessions, args.turns, args.concurrency, seed=100 + k,
                                            max_tokens=args.max_tokens, stream=True, chat=False,
                                            words=args.opening_words))
        wall = time.monotonic() - t0
        router.stop()
        h1, q1 = fleet.counters()
        ttft = [r["ttft"] for r in res if r["ttft"] is not None]
        failed = sum(r["failed"] is not None for r in res)
        line = (f"policy {policy:20s} hit rate {(h1 - h0) / max(q1 - q0, 1):.3f}  TTFT p50 {pct(ttft, .5) * 1e3:.0f} ms "
                f"p99 {pct(ttft, .99) * 1e3:.0f} ms  requests {len(res)} failed {failed}  wall {wall:.0f} s")
        print(line, flush=True)
        lines.append(line)
    return lines


def phase_failover(fleet: Fleet, run: Path, args) -> list[str]:
    router = Router("affinity", fleet.urls, run, None, ["--health-interval", "0.5"])
    total = args.failover_sessions * args.turns
    events = {}

    async def on_turn(done: int):
        if done == total // 3 and "kill" not in events:
            events["kill"] = time.monotonic()
            fleet.kill(0)
        if done == 2 * total // 3 and "restart" not in events:
            events["restart"] = time.monotonic()
            fleet.restart(0)
            await asyncio.to_thread(wait_up, fleet.urls[0])
            await asyncio.sleep(1.5)  # three health checks: the router has taken it back

    res = asyncio.run(sessions_workload(router.url, args.failover_sessions, args.turns, args.concurrency, seed=7,
                                        max_tokens=args.max_tokens, stream=False, on_turn=on_turn, explicit=True))
    router.stop()
    failed = [r for r in res if r["failed"]]
    ring = Policy("affinity", fleet.urls)  # the router's ring: each session's primary, known here
    dead = fleet.urls[0]
    owned = {r["session"] for r in res if ring.preference(explicit_key({"x-session-id": f"s7-{r['session']}"}, {}))[0]
             == dead}
    moved = {(r["session"], r["replica"]) for r in res if r["session"] in owned and r["replica"] != dead}
    spread = Counter(url for _, url in moved)
    back = {r["session"] for r in res if r["session"] in owned and r["replica"] == dead}
    even = sum(spread.values()) / max(len(spread), 1)
    worst = max((abs(v - even) / even for v in spread.values()), default=float("nan"))
    line = (f"failover: {len(res)} requests, {len(failed)} failed; of the killed replica's {len(owned)} sessions, "
            f"those served elsewhere went to the survivors as "
            f"{sorted(spread.values())} while it was down (worst {worst:.0%} off even); {len(back)} served by it before "
            f"the kill or after the restart")
    print(line, flush=True)
    for r in failed[:5]:
        print("  failed:", r["failed"])
    return [line]


async def completion(client, url, prompt, max_tokens) -> float | None:
    """Seconds to the first streamed token's event (its text may be empty: a byte of a character);
    None for a refused request."""
    t0 = time.monotonic()
    body = {"model": "run", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"choices"' in line:
                first = time.monotonic() - t0
        return first


async def admission_run(url: str, args, seed: int, burst: bool) -> dict:
    """Short completions arriving every --short-interval s, alone or from 0.2 s into a burst of
    --long-requests maximum-length prompts sent at once; every prompt unique (no prefix hits)."""
    rng = random.Random(seed)
    longs = [f"{seed}-{i} " + opening(rng, args.long_words) for i in range(args.long_requests if burst else 0)]
    shorts = [f"{seed}-{i} " + opening(rng, 8) for i in range(args.short_requests)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.monotonic()
        burst_tasks = [asyncio.create_task(completion(client, url, p, args.long_max_tokens)) for p in longs]
        if longs:
            await asyncio.sleep(0.2)
        short_tasks = []
        for p in shorts:
            short_tasks.append(asyncio.create_task(completion(client, url, p, 2)))
            await asyncio.sleep(args.short_interval)
        ttft = await asyncio.gather(*short_tasks)
        shorts_end = time.monotonic() - t0
        long_ttft = await asyncio.gather(*burst_tasks)
        burst_end = time.monotonic() - t0
    assert all(t is not None for t in ttft + long_ttft), "a request was refused (past --max-model-len?)"
    return {"short": ttft, "long": long_ttft, "shorts_end": shorts_end, "burst_end": burst_end if longs else 0.0}


OFF = ["--long-budget", "100000000", "--long-prefills", "100000000", "--short-replicas", "0"]  # no admission


def phase_admission(_: Fleet | None, run: Path, args) -> list[str]:
    """Replicas of --max-num-seqs 4 (--admission-serve-args): the burst holds several times the
    fleet's seats. Rounds interleave the three cases so that the load of the moment hits each."""
    fleet = Fleet(run, args.replicas, args.serve_args.split() + args.admission_serve_args.split())
    routers = {"on": Router("affinity", fleet.urls, run, None, args.admission_router_args.split()),
               "off": Router("affinity", fleet.urls, run, None, OFF)}
    cases = [("alone", "on", False), ("burst, budgets off", "off", True), ("burst, budgets on", "on", True)]
    got: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    try:
        # the replicas' first calls of each shape are slow (hundreds of ms): a short round, not measured
        warm = argparse.Namespace(**{**vars(args), "long_requests": 12, "short_requests": 20})
        asyncio.run(admission_run(routers["on"].url, warm, -1, True))
        for r in range(args.rounds):
            for k in range(len(cases)):
                name, router, burst = cases[(k + r) % len(cases)]
                res = asyncio.run(admission_run(routers[router].url, args, 1000 * r + 10 * k, burst))
                got[name].append(res)
                print(f"  round {r} {name:20s} short p50 {pct(res['short'], .5) * 1e3:5.0f} p99 "
                      f"{pct(res['short'], .99) * 1e3:5.0f} ms; shorts done {res['shorts_end']:.1f} s, "
                      f"burst done {res['burst_end']:.1f} s", flush=True)
    finally:
        for router in routers.values():
            router.stop()
        fleet.stop()
    base = pct([t for res in got["alone"] for t in res["short"]], .99)
    lines = []
    for name, _, burst in cases:
        short = [t for res in got[name] for t in res["short"]]
        rounds = " ".join(f"{pct(res['short'], .99) * 1e3:.0f}" for res in got[name])
        line = (f"admission {name:20s}: short TTFT p50 {pct(short, .5) * 1e3:.0f} ms p99 {pct(short, .99) * 1e3:.0f} ms "
                f"(x{pct(short, .99) / base:.2f} of alone; per round p99 {rounds} ms)")
        if burst:
            longs = [t for res in got[name] for t in res["long"]]
            line += (f"; long TTFT p50 {pct(longs, .5):.1f} s p99 {pct(longs, .99):.1f} s, burst done in "
                     f"{sum(res['burst_end'] for res in got[name]) / len(got[name]):.1f} s")
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="a k3 run to serve (default: a random-weight k3-tiny)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--failover-sessions", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--opening-words", type=int, default=150, help="words of each session's first prompt")
    ap.add_argument("--short-requests", type=int, default=40, help="admission: short completions per run")
    ap.add_argument("--short-interval", type=float, default=0.1, help="admission: seconds between short arrivals")
    ap.add_argument("--long-requests", type=int, default=36,
                    help="admission: long prompts per burst (3x the seats of 3 replicas of --max-num-seqs 4)")
    ap.add_argument("--long-max-tokens", type=int, default=8, help="admission: tokens each long prompt generates")
    ap.add_argument("--rounds", type=int, default=3, help="admission: rounds of the three cases, interleaved")
    ap.add_argument("--admission-serve-args", default="--max-num-seqs 4",
                    help="admission: more `k3 serve` options of its own fleet")
    ap.add_argument("--admission-router-args", default="--short-replicas 2",
                    help="admission: `k3 route` options of the budgets-on router (default: one replica prefills "
                         "long prompts, the other two are free for short ones: the 3 replicas share 2 cores)")
    ap.add_argument("--long-words", type=int, default=560,
                    help="words per long prompt (~1,900 tokens: near --max-model-len 2048)")
    ap.add_argument("--serve-args", default="--max-model-len 2048", help="extra `k3 serve` options of each replica")
    ap.add_argument("--sglang-python", help="a Python with sglang-router installed (adds its two policies)")
    ap.add_argument("--phases", default="policies,failover,admission")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else tiny_run(Path(tmp) / "run")
        phases = args.phases.split(",")
        # the admission phase starts its own fleet
        fleet = Fleet(run, args.replicas, args.serve_args.split()) if set(phases) - {"admission"} else None
        lines = []
        try:
            for phase in phases:
                lines += {"policies": phase_policies, "failover": phase_failover,
                          "admission": phase_admission}[phase](fleet, run, args)
        finally:
            if fleet is not None:
                fleet.stop()
    print(f"\n{os.cpu_count()} CPUs, {args.replicas} replicas x 1 thread, k3-tiny; {args.sessions} sessions x "
          f"{args.turns} turns, {args.concurrency} at a time")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
