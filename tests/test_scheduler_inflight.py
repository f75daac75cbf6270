"""One computation per shared prefix in flight: a burst of requests sharing a prompt computes
it once, for both backends and both policies, and outputs do not change."""

from __future__ import annotations

import random

import pytest
from sched_sim import simulate

from kvmosaic.engine.sampling_params import SamplingParams

PREFIX, SUFFIX, BURST = 800, 12, 16


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_burst_computes_the_shared_prefix_once(backend, policy):
    rng = random.Random(1)
    system = [rng.randrange(100, 40000) for _ in range(PREFIX)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(SUFFIX)] for _ in range(BURST)]
    run = simulate(prompts, backend, policy, num_blocks=256, max_num_seqs=32, budget=2048)
    queries = BURST * (PREFIX + SUFFIX)
    computed = queries - run.hit_rate * queries
    assert computed / (PREFIX + BURST * SUFFIX) <= 1.1, computed
    assert run.max_wait_rounds <= BURST  # passed over while the prefix was computed, no longer


def test_burst_outputs_equal_the_no_cache_engine():
    from tests.conftest import make_llm

    rng = random.Random(2)
    system = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa"]) for _ in range(60))
    prompts = [f"{system}\nQuestion {i}: name a colour." for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    on = make_llm(prefix_cache="hash", max_num_batched_tokens=2048).generate(prompts, params)
    off = make_llm(prefix_cache="none", max_num_batched_tokens=2048).generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert on[0].num_cached_tokens == 0 and all(o.num_cached_tokens > 0 for o in on[1:])
