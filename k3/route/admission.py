"""Budgeted admission: a burst of very long prompts must not ruin short requests' time to first
token (K3 report §7.4).

Requests are short or long by their prompt length. Each replica has a budget of prompt tokens in
flight per class; a request that does not fit waits at the router, first come first served within
its class, until one of its class finishes there. Short requests never wait behind long ones: a
replica gets at most `long` tokens of long prompts at a time, so its scheduler always has seats and
pages left for the short ones. A request larger than its whole budget runs alone in its class.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
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

    def __post_init__(self):
        for name in ("long_prompt_tokens", "short", "long"):
            if getattr(self, name) < 1:
                raise ValueError(f"admission {name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"admission timeout must be > 0, got {self.timeout}")


class Admission:
    def __init__(self, budgets: Budgets = Budgets()):
        self.budgets = budgets
        self.used: dict[tuple[str, str], int] = defaultdict(int)  # (replica, class) -> prompt tokens in flight
        self._waiters: dict[tuple[str, str], deque] = defaultdict(deque)  # of (tokens, future)

    def classify(self, tokens: int) -> str:
        return LONG if tokens >= self.budgets.long_prompt_tokens else SHORT

    def waiting(self, cls: str) -> int:
        return sum(len(q) for (_, c), q in self._waiters.items() if c == cls)

    @asynccontextmanager
    async def slot(self, replica: str, tokens: int):
        """Hold `tokens` of the replica's budget for the request's class while the block runs;
        yields the seconds it waited. AdmissionTimeout, ReplicaGone when it cannot."""
        key = (replica, self.classify(tokens))
        t0 = time.monotonic()
        if not self._waiters[key] and self._fits(key, tokens):
            self.used[key] += tokens
        else:
            await self._wait(key, tokens)
        try:
            yield time.monotonic() - t0
        finally:
            self.used[key] -= tokens
            self._wake(key)

    async def _wait(self, key, tokens: int) -> None:
        future = asyncio.get_running_loop().create_future()
        entry = (tokens, future)
        self._waiters[key].append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.budgets.timeout)
        except BaseException as e:
            if entry in self._waiters[key]:
                self._waiters[key].remove(entry)
            elif future.done() and not future.cancelled() and future.exception() is None:
                self.used[key] -= tokens  # granted as the wait ended: give it back
                self._wake(key)
            if isinstance(e, TimeoutError):
                raise AdmissionTimeout(f"waited {self.budgets.timeout:g} s for a {key[1]} request's budget") from None
            raise

    def _fits(self, key, tokens: int) -> bool:
        budget = self.budgets.long if key[1] == LONG else self.budgets.short
        return self.used[key] == 0 or self.used[key] + tokens <= budget

    def _wake(self, key) -> None:
        queue = self._waiters[key]
        while queue and self._fits(key, queue[0][0]):
            tokens, future = queue.popleft()
            if not future.done():
                self.used[key] += tokens
                future.set_result(None)

    def drop(self, replica: str) -> None:
        """The replica is down: its waiters go elsewhere (ReplicaGone)."""
        for key, queue in self._waiters.items():
            if key[0] == replica:
                while queue:
                    _, future = queue.popleft()
                    if not future.done():
                        future.set_exception(ReplicaGone(replica))
