"""Budgeted admission: a burst of very long prompts must not ruin short requests' time to first
token (K3 report §7.4).

Requests are short or long by their prompt length. A replica's engine computes its running
requests' prefill chunks before it admits a waiting request, and a step with a long prompt's chunk
is slow, so a short request that meets a long prefill on its replica waits for it, whatever the
router's budgets. Hence (docs/ROUTING.md):
- short requests have a budget of prompt tokens in flight per replica and their own queue; they
  never wait for a long one, and they go to the first replica of their preference order that is
  not prefilling a long prompt (their prefix is short: re-prefilling it elsewhere is cheap);
- long requests have a budget of prompt tokens in flight per replica, at most `long_prefills`
  prefills at once per replica, none where a short request waits for its first token, and at most
  `up - short_replicas` replicas prefilling long prompts at once, so that some replicas stay free
  for short requests; they wait in one queue, first come first served per replica (a long request
  waiting for a busy replica holds up no other replica's);
- a request larger than its whole budget runs alone in its class on its replica.
A request's prefill ends at its first streamed token (`Grant.prefilled`), or with the request.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

SHORT, LONG = "short", "long"


class AdmissionTimeout(Exception):
    """Waited longer than the queue timeout (a 429 to the client)."""


class ReplicaGone(Exception):
    """The replica this request waited for went down (the router tries the next one)."""


@dataclass(frozen=True)
class Budgets:
    long_prompt_tokens: int = 1024  # a prompt of at least this many tokens is long
    short: int = 16384  # prompt tokens of short requests in flight per replica
    long: int = 4096  # prompt tokens of long requests in flight per replica
    timeout: float = 120.0  # seconds a request may wait for its budget
    short_replicas: int = 1  # replicas kept free of long prefills (while more than this many are up)
    long_prefills: int = 1  # long requests before their first token, per replica

    def __post_init__(self):
        for name in ("long_prompt_tokens", "short", "long", "long_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"admission {name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"admission timeout must be > 0, got {self.timeout}")
        if self.short_replicas < 0:
            raise ValueError(f"admission short replicas must be >= 0, got {self.short_replicas}")


@dataclass
class _Waiter:
    replica: str
    tokens: int
    future: asyncio.Future


class Grant:
    """A request's admission on one replica: how long it waited, and `prefilled()` to call at its
    first token (idempotent; its prefill counts until then or until it ends)."""

    def __init__(self, admission: Admission, replica: str, cls: str, waited: float):
        self.admission, self.replica, self.cls, self.waited = admission, replica, cls, waited
        self.prefilling = True

    def prefilled(self) -> None:
        if self.prefilling:
            self.prefilling = False
            self.admission._end_prefill(self.replica, self.cls)


class Admission:
    def __init__(self, budgets: Budgets = Budgets(), alive: Callable[[], int] = lambda: 1):
        self.budgets = budgets
        self.alive = alive  # how many replicas are up now (the router's replica set)
        self.used: dict[tuple[str, str], int] = defaultdict(int)  # (replica, class) -> prompt tokens in flight
        self.prefilling: dict[tuple[str, str], int] = defaultdict(int)  # (replica, class) -> before a first token
        self._waiters: dict[str, deque[_Waiter]] = {SHORT: deque(), LONG: deque()}

    def classify(self, tokens: int) -> str:
        return LONG if tokens >= self.budgets.long_prompt_tokens else SHORT

    def waiting(self, cls: str) -> int:
        return len(self._waiters[cls])

    def order(self, cls: str, order: list[str]) -> list[str]:
        """A short request's preference order with the replicas prefilling a long prompt last."""
        if cls == LONG:
            return order
        busy = {u for u in order if self.prefilling[(u, LONG)]}
        return [u for u in order if u not in busy] + [u for u in order if u in busy]

    @asynccontextmanager
    async def slot(self, replica: str, tokens: int):
        """Hold `tokens` of the replica's budget for the request's class while the block runs;
        yields its Grant. AdmissionTimeout, ReplicaGone when it cannot."""
        cls = self.classify(tokens)
        t0 = time.monotonic()
        waiter = _Waiter(replica, tokens, asyncio.get_running_loop().create_future())
        self._waiters[cls].append(waiter)
        self._wake(cls)
        if not waiter.future.done():
            await self._wait(cls, waiter)
        grant = Grant(self, replica, cls, time.monotonic() - t0)
        try:
            yield grant
        finally:
            grant.prefilled()
            self.used[(replica, cls)] -= tokens
            self._wake(cls)

    async def _wait(self, cls: str, waiter: _Waiter) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.budgets.timeout)
        except BaseException as e:
            if waiter in self._waiters[cls]:
                self._waiters[cls].remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self._release(cls, waiter)  # granted as the wait ended: give it back
            if isinstance(e, TimeoutError):
                raise AdmissionTimeout(f"waited {self.budgets.timeout:g} s for a {cls} request's budget") from None
            raise

    def _release(self, cls: str, waiter: _Waiter) -> None:
        self.used[(waiter.replica, cls)] -= waiter.tokens
        self._end_prefill(waiter.replica, cls)
        self._wake(cls)

    def _fits(self, cls: str, replica: str, tokens: int) -> bool:
        used = self.used[(replica, cls)]
        if used and used + tokens > (self.budgets.long if cls == LONG else self.budgets.short):
            return False
        if cls == SHORT:
            return True
        if self.prefilling[(replica, SHORT)]:
            return False
        if self.prefilling[(replica, LONG)]:
            return self.prefilling[(replica, LONG)] < self.budgets.long_prefills
        busy = sum(1 for (_, c), n in self.prefilling.items() if c == LONG and n)
        return busy < max(1, self.alive() - self.budgets.short_replicas)

    def _wake(self, cls: str) -> None:
        """Grant the waiters that fit, in arrival order; one that does not fit holds up only the
        later waiters for its own replica."""
        blocked: set[str] = set()
        queue = self._waiters[cls]
        for waiter in list(queue):
            if waiter.replica in blocked:
                continue
            if not self._fits(cls, waiter.replica, waiter.tokens):
                blocked.add(waiter.replica)
                continue
            queue.remove(waiter)
            self.used[(waiter.replica, cls)] += waiter.tokens
            self.prefilling[(waiter.replica, cls)] += 1
            waiter.future.set_result(None)

    def _end_prefill(self, replica: str, cls: str) -> None:
        self.prefilling[(replica, cls)] -= 1
        self._wake(LONG)

    def drop(self, replica: str) -> None:
        """The replica is down: its waiters go elsewhere (ReplicaGone), and the fleet has one
        replica fewer to prefill on."""
        for queue in self._waiters.values():
            for waiter in [w for w in queue if w.replica == replica]:
                queue.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(ReplicaGone(replica))
        self._wake(LONG)
