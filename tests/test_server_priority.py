"""vLLM's request field ``priority`` (lower first) under ``--scheduling-policy priority``, on one
process and through ``--replicas 2``: a more urgent request overtakes the queue and preempts a
less urgent one running; without the policy a priority other than 0 is a 400, as in vLLM."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvmosaic.server.launch import ServerProcess

C = "/v1/completions"


@pytest.fixture(scope="module", params=[None, 2], ids=["one-process", "replicas-2"])
def server(request):
    replicas = ["--replicas", str(request.param)] if request.param else []
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "64", "--max-num-seqs", "1",
                       "--scheduling-policy", "priority", *replicas) as proc:
        proc.replicas = request.param
        yield proc


def _complete(server, prompt: str, priority: int, max_tokens: int, done: list) -> None:
    r = httpx.post(server.url + C, json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True, "priority": priority}, timeout=120)
    assert r.status_code == 200, r.text
    done.append(priority)


def _idle(server) -> None:
    deadline = time.monotonic() + 30
    while any(h["kv"]["num_used_blocks"] or h["requests"] != {"running": 0, "waiting": 0}
              for h in server.pool_healths()):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_priority_is_accepted_and_served(server):
    done: list[int] = []
    for p in (-3, 0, 7):
        _complete(server, "Name a colour.", p, 2, done)
    assert done == [-3, 0, 7]
    _idle(server)


def test_an_urgent_request_overtakes_and_preempts(server):
    """One running slot: a long request (priority 0) streams; a lax one (5) waits behind it; an urgent
    one (-5) preempts the long one and ends first; the long one resumes before the lax one."""
    if server.replicas:
        pytest.skip("the order is a replica's: requests of different prompts may go to different replicas")
    done: list[int] = []
    with httpx.stream("POST", server.url + C, json={"prompt": "Count: one, two,", "max_tokens": 96, "temperature": 0,
                                                    "ignore_eos": True, "stream": True}, timeout=120) as long:
        lines = long.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # running
        lax = threading.Thread(target=_complete, args=(server, "A lax question.", 5, 4, done))
        lax.start()
        time.sleep(0.3)
        urgent = threading.Thread(target=_complete, args=(server, "An urgent question.", -5, 4, done))
        urgent.start()
        for line in lines:
            if line == "data: [DONE]":
                done.append(0)
    lax.join()
    urgent.join()
    assert done == [-5, 0, 5]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert any(line.startswith("kvmosaic:num_preemptions_total{") and float(line.rsplit(" ", 1)[1]) >= 1
               for line in metrics.splitlines())
    _idle(server)


def test_without_the_policy_priority_is_a_400():
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "32") as proc:
        r = httpx.post(proc.url + C, json={"prompt": "x", "max_tokens": 1, "priority": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
        assert httpx.post(proc.url + C, json={"prompt": "x", "max_tokens": 1, "priority": 0}, timeout=60).status_code == 200


def test_the_priority_eviction_policy_reads_it_too():
    """``--eviction-policy priority`` ranks cached blocks by their requests' priority: the field is
    served there as well (negated as for scheduling: a lower vLLM priority is kept longer)."""
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "32", "--eviction-policy", "priority") as proc:
        r = httpx.post(proc.url + C, json={"prompt": "x", "max_tokens": 1, "priority": -2}, timeout=60)
        assert r.status_code == 200, r.text
