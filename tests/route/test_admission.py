"""Budgeted admission: short requests never wait behind long ones and avoid replicas prefilling a
long prompt; long requests prefill one per replica, never beside a short one's prefill, on at most
`up - short_replicas` replicas, and wait first come first served per replica without holding up
other replicas; an oversized request runs alone; every way out (end, error, cancel, timeout,
replica down) gives the budget back."""
from __future__ import annotations

import asyncio

import pytest

from k3.route.admission import LONG, SHORT, Admission, AdmissionTimeout, Budgets, ReplicaGone


def run(coro):
    return asyncio.run(coro)


async def settle():
    await asyncio.sleep(0.005)  # a granted waiter's task runs on (wait_for and shield take a few loop turns)


def idle(adm: Admission) -> bool:
    return not any(adm.used.values()) and not any(adm.prefilling.values()) and not adm.waiting(SHORT) \
        and not adm.waiting(LONG)


def test_long_requests_wait_for_their_budget_short_ones_do_not():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=100, short=50, long=150, timeout=5))
        order = []

        async def req(name, tokens, hold):
            async with adm.slot("r", tokens):
                order.append(name)
                await asyncio.sleep(hold)

        longs = [asyncio.create_task(req(f"L{i}", 100, 0.05)) for i in range(3)]
        await settle()
        assert adm.waiting(LONG) == 2  # one long prompt of 150 tokens' budget runs, the rest wait
        await req("S", 10, 0)  # not behind them
        await asyncio.gather(*longs)
        return order, adm

    order, adm = run(go())
    assert order == ["L0", "S", "L1", "L2"] and idle(adm)


class Holder:
    """A request holding its slot until `done` is set; `grant` once admitted."""

    def __init__(self, adm: Admission, replica: str, tokens: int):
        self.grant, self.done = None, asyncio.Event()
        self.task = asyncio.create_task(self._hold(adm, replica, tokens))

    async def _hold(self, adm, replica, tokens):
        async with adm.slot(replica, tokens) as grant:
            self.grant = grant
            await self.done.wait()


def test_long_prefills_leave_replicas_free_for_short_requests():
    async def go():
        up = 3
        adm = Admission(Budgets(long_prompt_tokens=100, long=1000, timeout=5), alive=lambda: up)
        a1, a2 = Holder(adm, "a", 100), Holder(adm, "a", 100)  # one prefill per replica
        b1 = Holder(adm, "b", 100)
        c1 = Holder(adm, "c", 100)  # 2 of 3 replicas prefill: c stays free
        await settle()
        assert a1.grant and b1.grant and not a2.grant and not c1.grant and adm.waiting(LONG) == 2
        assert adm.order(SHORT, ["a", "b", "c"]) == ["c", "a", "b"]  # short ones go where no prefill runs
        assert adm.order(LONG, ["a", "b", "c"]) == ["a", "b", "c"]
        a1.grant.prefilled()  # a's first token: its prefill is done, its budget still held
        await settle()
        assert a2.grant and not c1.grant and adm.used[("a", LONG)] == 200
        b1.done.set()  # b ends before its first token: its prefill ends with it
        await settle()
        assert c1.grant and {k: n for k, n in adm.prefilling.items() if n} == {("a", LONG): 1, ("c", LONG): 1}
        up = 1  # fewer replicas up: still one prefill at a time, never none
        b2 = Holder(adm, "b", 100)
        await settle()
        assert not b2.grant
        a2.done.set(), c1.done.set()
        await settle()
        assert b2.grant
        for h in (a1, b2):
            h.done.set()
        await settle()
        assert idle(adm)

    run(go())


def test_a_long_request_waiting_for_its_replica_holds_up_no_other_replica():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=100, long=100, timeout=5, short_replicas=0), alive=lambda: 2)
        a1 = Holder(adm, "a", 100)
        await settle()
        a1.grant.prefilled()
        a2, b1 = Holder(adm, "a", 100), Holder(adm, "b", 100)  # a's budget is full; b is behind a2 in the queue
        await settle()
        assert b1.grant and not a2.grant
        b1.done.set()
        await settle()
        assert not a2.grant
        a1.done.set()
        await settle()
        assert a2.grant
        a2.done.set()
        await settle()
        assert idle(adm)

    run(go())


def test_budgets_come_back_on_error_cancel_and_timeout():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=10, short=5, long=20, timeout=0.05))
        with pytest.raises(RuntimeError):
            async with adm.slot("r", 10):
                raise RuntimeError("the replica failed")  # a failed request gives its budget back
        async with adm.slot("r", 10):
            waiter = asyncio.create_task(adm.slot("r", 10).__aenter__())
            await settle()
            waiter.cancel()  # a client gone while waiting
            await settle()
            with pytest.raises(AdmissionTimeout):
                async with adm.slot("r", 10):
                    pass
        assert idle(adm)

    run(go())


def test_an_oversized_request_runs_alone_and_waits_end():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=10, short=5, long=20, timeout=0.05))
        async with adm.slot("r", 1000) as g:  # larger than the whole budget: admitted into an empty class
            g.prefilled()
            with pytest.raises(AdmissionTimeout):
                async with adm.slot("r", 10):
                    pass
            waiter = asyncio.create_task(adm.slot("r", 10).__aenter__())
            await settle()
            adm.drop("r")
            with pytest.raises(ReplicaGone):
                await waiter
        assert idle(adm)

    run(go())


def test_bad_budgets_are_one_line():
    with pytest.raises(ValueError, match="short must be >= 1"):
        Budgets(short=0)
    with pytest.raises(ValueError, match="short replicas must be >= 0"):
        Budgets(short_replicas=-1)


def test_a_chat_streams_opening_role_chunk_is_not_its_first_token():
    from k3.route.app import _generated

    role = '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
    assert not _generated(role)
    assert _generated('{"choices": [{"index": 0, "delta": {"content": "hi"}}]}')
    assert _generated('{"choices": [{"index": 0, "text": ""}]}')  # a completion's token (a byte of a character)


def test_no_long_prefill_starts_where_a_short_request_waits_for_its_first_token():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=100, timeout=5, short_replicas=0), alive=lambda: 2)
        short = Holder(adm, "a", 10)
        await settle()
        long = Holder(adm, "a", 100)
        await settle()
        assert not long.grant  # it would take the engine's step budget ahead of the short one's prefill
        short.grant.prefilled()
        await settle()
        assert long.grant
        short.done.set(), long.done.set()
        await settle()
        assert idle(adm)

    run(go())
