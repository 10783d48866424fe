"""Budgeted admission: short requests never wait behind long ones, a class waits first come first
served, an oversized request runs alone, and waiting ends (timeout, replica down)."""
from __future__ import annotations

import asyncio

import pytest

from k3.route.admission import Admission, AdmissionTimeout, Budgets, ReplicaGone


def run(coro):
    return asyncio.run(coro)


def test_long_requests_wait_for_their_budget_short_ones_do_not():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=100, short=50, long=150, timeout=5))
        order = []

        async def req(name, tokens, hold):
            async with adm.slot("r", tokens):
                order.append(name)
                await asyncio.sleep(hold)

        longs = [asyncio.create_task(req(f"L{i}", 100, 0.05)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert adm.waiting("long") == 2  # one long prompt of 150 tokens' budget runs, the rest wait
        await req("S", 10, 0)  # not behind them
        await asyncio.gather(*longs)
        return order, adm

    order, adm = run(go())
    assert order == ["L0", "S", "L1", "L2"] and not any(adm.used.values())


def test_an_oversized_request_runs_alone_and_waits_end():
    async def go():
        adm = Admission(Budgets(long_prompt_tokens=10, short=5, long=20, timeout=0.05))
        async with adm.slot("r", 1000):  # larger than the whole budget: admitted into an empty class
            with pytest.raises(AdmissionTimeout):
                async with adm.slot("r", 10):
                    pass
            waiter = asyncio.create_task(adm.slot("r", 10).__aenter__())
            await asyncio.sleep(0)
            adm.drop("r")
            with pytest.raises(ReplicaGone):
                await waiter
        assert adm.used[("r", "long")] == 0

    run(go())


def test_bad_budgets_are_one_line():
    with pytest.raises(ValueError, match="short must be >= 1"):
        Budgets(short=0)
