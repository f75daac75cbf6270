"""Anticipation (engine/anticipation.py): the next step waits a few milliseconds for a tenant
that sends one request at a time, and only for such a tenant.

* rules, on a hand-driven clock: nothing is held before a tenant's think time is known, for a
  tenant that comes back later than the window, for the tenant served most, with one tenant, or
  with the window 0; a hold ends at the window's end, counts once per idle period, and a return
  inside it counts as a hit;
* scheduler: a tenant's last request leaving (finished or aborted) starts its idle period, its
  next request ends it, measured from when that request reached the server
  (``add_processed(arrival_time=)``), not from when a step let it in;
* server: tenant B sends 12 short requests one at a time beside tenant A's long ones; the engine
  held for B's next request and B came back inside the hold (``/metrics``), never longer than the
  window per hold (200 ms here: CI machines are busy); A's and B's outputs equal the engine's without anticipation;
  through ``--replicas 2`` each replica reports its counters through the front, within the same bound,
  and the answers are one server's.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvmosaic.engine.anticipation import Anticipation
from kvmosaic.engine.sampling_params import SamplingParams
from kvmosaic.server.launch import ServerProcess


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hold_rules_on_a_hand_driven_clock():
    clock = Clock()
    a = Anticipation(0.010, clock)
    served = {"A": 5000.0, "B": 40.0}
    a.went_idle("B")
    assert a.hold({"A"}, served) == 0  # B's think time is not known yet
    clock.now += 0.003
    a.arrived("B", clock.now)
    assert abs(a.think["B"] - 0.003) < 1e-9 and a.hits == 0  # learned, nothing was held for

    a.went_idle("B")
    clock.now += 0.004
    assert abs(a.hold({"A"}, served) - 0.006) < 1e-9  # until the window's end from going idle
    assert a.hold({"A"}, served) > 0 and a.holds == 1  # one idle period, counted once
    assert a.hold({"A"}, {"A": 10.0, "B": 40.0}) == 0  # B is served more than A: no express step for it
    assert a.hold(set(), served) == 0  # nobody else has work: the engine idles anyway
    a.arrived("B", clock.now)
    assert a.hits == 1 and a.hold({"A"}, served) == 0

    a.went_idle("B")
    clock.now += 0.011
    assert a.hold({"A"}, served) == 0  # past the window
    for _ in range(8):  # B now comes back after 50 ms each time: its average leaves the window
        a.arrived("B", clock.now + 0.05)
        a.went_idle("B")
    assert a.think["B"] > 0.010 and a.hold({"A"}, served) == 0

    off = Anticipation(0.0, clock)
    off.went_idle("B")
    off.arrived("B", clock.now)
    off.went_idle("B")
    assert off.hold({"A"}, served) == 0 and off.holds == 0


def test_scheduler_idle_periods_start_when_the_last_request_leaves():
    from tests.test_fair_share import make_engine

    engine = make_engine(fair_share_anticipation_ms=50)
    clock = Clock()
    engine.scheduler.anticipation.clock = clock
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request(list(range(2000, 2400)), SamplingParams(max_tokens=64, temperature=0.0),
                       request_id="a").tenant = "A"
    engine.step()
    b = engine.add_request(list(range(5000, 5020)), params, request_id="b1")
    b.tenant = "B"
    engine.add_request(list(range(6000, 6020)), params, request_id="b2").tenant = "B"
    while "b1" in engine.requests or "b2" in engine.requests:
        engine.step()
    anticipation = engine.scheduler.anticipation
    assert "B" in anticipation.idle_since and "A" not in anticipation.idle_since  # B's last left, A runs
    went = anticipation.idle_since["B"]
    clock.now = went + 0.030  # the step in progress ends 30 ms after B went idle ...
    seq = engine.inputs.process([7000, 7001, 7002])
    engine.add_processed(seq, params, request_id="b3", tenant="B", arrival_time=went + 0.002)
    assert abs(anticipation.think["B"] - 0.002) < 1e-9  # ... but B's request reached the server at 2 ms
    engine.abort_request("b3")
    assert anticipation.idle_since["B"] == clock.now  # an abort is a leaving too
    assert engine.scheduler.hold() > 0  # B is back within 50 ms as a rule, A has work
    engine.abort_request("a")
    assert engine.scheduler.hold() == 0  # nobody else has work


async def one_at_a_time_beside_a_flood(url: str) -> tuple[list[str], list[str]]:
    """Tenant A's 4 long completions, and beside them tenant B's 12 short ones, one at a time."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def complete(key: str, prompt: str, max_tokens: int) -> str:
            r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        a = [asyncio.create_task(complete("key-a", f"Story {i}: " + "once upon a time " * 60, 24)) for i in range(4)]
        b = [await complete("key-b", f"Question {i}: what is {i} plus {i}?", 3) for i in range(12)]
        return [await t for t in a], b


def anticipation_counters(server: ServerProcess) -> dict[str, float]:
    """``holds``, ``hits``, ``held_seconds`` from /metrics, summed over replicas (one series each)."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer adm"}).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvmosaic:fair_share_anticipation_"):
            name = line.split("{")[0].removeprefix("kvmosaic:fair_share_anticipation_").removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


FLAGS = ("--dtype", "float32", "--api-key", "key-a", "--api-key", "key-b", "--admin-key", "adm")


@pytest.fixture(scope="module")
def without_anticipation() -> tuple[list[str], list[str]]:
    """A's and B's answers from one server that never holds (the reference for both tests)."""
    with ServerProcess(*FLAGS, "--fair-share-anticipation-ms", "0") as server:
        return asyncio.run(one_at_a_time_beside_a_flood(server.url))


def test_server_holds_for_a_one_at_a_time_tenant_and_outputs_are_unchanged(without_anticipation):
    with ServerProcess(*FLAGS, "--fair-share-anticipation-ms", "200") as server:  # wide: CI machines are busy
        outputs = asyncio.run(one_at_a_time_beside_a_flood(server.url))
        counted = anticipation_counters(server)
    assert outputs == without_anticipation
    assert counted["holds"] >= 1 and counted["hits"] >= 1
    assert counted["held_seconds"] <= counted["holds"] * 0.200 + 0.005


def test_through_replicas_the_option_reaches_each_replica_and_outputs_are_unchanged(without_anticipation):
    """Behind ``--replicas 2`` each replica's engine anticipates on its own (B's replica holds only
    when A has work there too, which the router decides): the counters come through the front per
    replica, within the window's bound, and the answers equal one server's without anticipation."""
    with ServerProcess(*FLAGS, "--fair-share-anticipation-ms", "200", "--replicas", "2") as server:
        assert asyncio.run(one_at_a_time_beside_a_flood(server.url)) == without_anticipation
        for _ in range(10):  # a scrape leaves out a replica that did not answer in time (the front logs it)
            text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer adm"}).text
            series = [line for line in text.splitlines() if line.startswith("kvmosaic:fair_share_anticipation_holds_total{")]
            if len(series) == 2:
                break
            time.sleep(1)
        else:
            server.log.flush()
            raise AssertionError(f"one series per replica, got {series}; the server said:\n"
                                 + open(server.log.name).read()[-4000:])
        counted = anticipation_counters(server)
    assert counted["held_seconds"] <= counted["holds"] * 0.200 + 0.005
