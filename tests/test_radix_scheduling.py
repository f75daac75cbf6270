"""Cache-aware scheduling: LPM ordering raises the hit rate under cache pressure on a
multi-tenant workload, and its starvation bound holds. Model-free: the real Scheduler and
cache managers, driven by the step loop of ``tests/sched_sim.py``."""

from __future__ import annotations

import random

import pytest
from sched_sim import multi_tenant, simulate


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_lpm_beats_fcfs_under_pressure(backend):
    prompts = multi_tenant(random.Random(0), tenants=6, requests=60)
    fcfs = simulate(prompts, backend, "fcfs", num_blocks=48)
    lpm = simulate(prompts, backend, "lpm", num_blocks=48)
    assert lpm.hit_rate > fcfs.hit_rate + 0.15, (fcfs.hit_rate, lpm.hit_rate)
    # FCFS passes a request over only while another computes the block it would hit next
    # (one computation per shared prefix in flight), i.e. for at most one step's admissions.
    assert fcfs.max_wait_rounds <= 4


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_lpm_starvation_bound(backend):
    rng = random.Random(5)
    system = [rng.randrange(200, 40000) for _ in range(200)]
    lone = [rng.randrange(200, 40000) for _ in range(50)]
    # One tenant's requests keep hitting; a lone request with no hit arrives second.
    prompts = [system + [1]] + [lone] + [system + [i, i + 1] for i in range(2, 40)]
    max_seqs, max_skips = 1, 8
    run = simulate(prompts, backend, "lpm", num_blocks=64, max_num_seqs=max_seqs)
    # A request is passed by at most max_skips admissions, plus those of the round in which
    # it crossed the bound (at most max_seqs - 1 more).
    assert 0 < run.max_wait_rounds <= max_skips - 1 + max_seqs
