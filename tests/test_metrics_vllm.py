"""vLLM's metrics: sampled block residency, the prefix renaming, the per-request phases."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvmosaic.cache.block_pool import BlockPool
from kvmosaic.cache.residency import RESIDENCY_BUCKETS, BlockResidency
from kvmosaic.engine.output_processor import RequestOutput
from kvmosaic.server.args import ServerArgs
from kvmosaic.server.metrics_vllm import PrefixedCollector, build_1_2_5_buckets, check_prefix


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_residency_lifetime_idle_and_gaps_through_the_pool():
    clock = Clock()
    res = BlockResidency(1.0, clock=clock)
    pool = BlockPool(2, 4, residency=res)
    [a] = pool.get_new_blocks(1)  # allocated at 100
    pool.cache_block(a, b"h" * 32, None, [1, 2, 3, 4])
    clock.t = 103.0
    pool.free_blocks([a])
    pool.touch([a])  # a hit at 103: gap 3
    pool.free_blocks([a])
    clock.t = 110.0
    pool.get_new_blocks(2)  # one truly free block, then `a` is evicted at 110
    snap = res.snapshot()
    assert snap["lifetime"]["count"] == 1 and snap["lifetime"]["sum"] == 10.0
    assert snap["idle_before_evict"]["sum"] == 7.0
    assert snap["reuse_gap"]["count"] == 1 and snap["reuse_gap"]["sum"] == 3.0
    assert len(snap["lifetime"]["buckets"]) == len(RESIDENCY_BUCKETS) + 1
    assert snap["lifetime"]["buckets"][RESIDENCY_BUCKETS.index(10)] == 1  # 10 s falls in the le=10 bucket


def test_residency_sampling_and_reset():
    res = BlockResidency(0.0)
    pool = BlockPool(1, 4, residency=res)
    [a] = pool.get_new_blocks(1)
    pool.cache_block(a, b"x" * 32, None, [0] * 4)
    pool.free_blocks([a])
    pool.get_new_blocks(1)
    assert res.snapshot()["lifetime"]["count"] == 0  # not sampled: nothing observed
    res = BlockResidency(1.0)
    pool = BlockPool(1, 4, residency=res)
    [a] = pool.get_new_blocks(1)
    pool.cache_block(a, b"x" * 32, None, [0] * 4)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    pool.get_new_blocks(1)
    assert res.snapshot()["lifetime"]["count"] == 0  # a reset is not an eviction
    with pytest.raises(ValueError):
        BlockResidency(1.5)


def test_prefix_renames_families_and_samples():
    reg = CollectorRegistry()
    Counter("kvmosaic:prefix_cache_hits", "hits", ["model_name"], registry=reg).labels("m").inc(3)
    Counter("other_total_thing", "left alone", registry=reg).inc()
    out = CollectorRegistry()
    out.register(PrefixedCollector(reg, "vllm:"))
    text = generate_latest(out).decode()
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 3.0' in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text and "kvmosaic:" not in text
    assert "other_total_thing_total 1.0" in text


@pytest.mark.parametrize("bad", ["vllm", "1x:", "a b:", ""])
def test_bad_prefix_is_refused_before_anything_starts(bad):
    with pytest.raises(ValueError, match="metrics prefix"):
        check_prefix(bad)
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerArgs(metrics_prefix=bad)


def test_vllm_token_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192)[-1] == 5000


def test_request_phases_observed_once_at_finish():
    from types import SimpleNamespace

    from kvmosaic.server.metrics import ServerMetrics
    from kvmosaic.server.metrics_vllm import VllmMetrics

    info = SimpleNamespace(max_model_len=1024, block_size=16, num_kv_blocks=8, dtype="float32",
                           prefix_cache="hash", hash_algo="sha256")
    sm = ServerMetrics(lambda: None, "m")  # its engine collector is not scraped below
    sm.registry = CollectorRegistry()
    vm = VllmMetrics(sm, lambda: SimpleNamespace(kv_residency={}, kv_tiers={}, kv_cache_usage=0.0,
                                                     num_waiting=0, num_waiting_for_kv=0), info, "vllm:")
    out = RequestOutput("r", None, list(range(40)), "abc", [1, 2, 3, 4], num_cached_tokens=16, finished=True,
                        finish_reason="length", metrics={
                            "arrival_time": 10.0, "ttft": 0.5, "first_scheduled_time": 10.25,
                            "first_token_time": 10.5, "last_token_time": 11.1, "finish_time": 11.1,
                            "itl": [0.2, 0.2, 0.2], "num_tier_tokens": 0, "max_tokens": 4, "n": 1})
    vm.on_finish(out)
    vm.on_iteration(40)
    text = generate_latest(vm.exposed).decode()

    def value(line: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(line)).rsplit(" ", 1)[1])

    assert value('vllm:request_queue_time_seconds_sum{model_name="m"}') == 0.25
    assert value('vllm:request_prefill_time_seconds_sum{model_name="m"}') == 0.25
    assert value('vllm:request_decode_time_seconds_sum{model_name="m"}') == pytest.approx(0.6)
    assert value('vllm:request_inference_time_seconds_sum{model_name="m"}') == pytest.approx(0.85)
    assert value('vllm:request_time_per_output_token_seconds_sum{model_name="m"}') == pytest.approx(0.2)
    assert value('vllm:inter_token_latency_seconds_count{model_name="m"}') == 3
    assert value('vllm:request_prefill_kv_computed_tokens_sum{model_name="m"}') == 24
    assert value('vllm:prompt_tokens_by_source_total{model_name="m",source="local_cache_hit"}') == 16
    assert value('vllm:prompt_tokens_by_source_total{model_name="m",source="local_compute"}') == 24
    assert value('vllm:time_to_first_token_by_cache_seconds_count{cache="hit",model_name="m"}') == 1
    assert value('vllm:iteration_tokens_total_sum{model_name="m"}') == 40
    assert 'vllm:cache_config_info{block_size="16"' in text
    out.finish_reason = "error"  # a failed request is not observed
    vm.on_finish(out)
    assert value('vllm:request_queue_time_seconds_count{model_name="m"}') == 1


# The names vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# queries, read 2026-11-23: with --metrics-prefix vllm: each must be exposed.
VLLM_DASHBOARD_NAMES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
    "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)


def test_vllm_dashboard_names_are_exposed_under_the_vllm_prefix():
    from dataclasses import fields
    from types import SimpleNamespace

    from kvmosaic.engine.stats import EngineStats
    from kvmosaic.server.metrics import ServerMetrics
    from kvmosaic.server.metrics_vllm import VllmMetrics

    stats = EngineStats(**{f.name: 0 for f in fields(EngineStats) if f.name not in ("kv_tiers", "kv_residency")})
    info = SimpleNamespace(max_model_len=1024, block_size=16, num_kv_blocks=8, dtype="float32",
                           prefix_cache="hash", hash_algo="sha256")
    sm = ServerMetrics(lambda: stats, "m")
    vm = VllmMetrics(sm, lambda: stats, info, "vllm:")
    out = RequestOutput("r", None, [1, 2], "ab", [3, 4], num_cached_tokens=0, finished=True, finish_reason="stop",
                        metrics={"arrival_time": 1.0, "ttft": 0.1, "e2e": 0.3, "first_scheduled_time": 1.0,
                                 "first_token_time": 1.1, "last_token_time": 1.3, "finish_time": 1.3, "itl": [0.2],
                                 "num_tier_tokens": 0, "max_tokens": 2, "n": 1})
    sm.on_finish(out)
    vm.on_finish(out)
    exposed = {line.split("{")[0].split(" ")[0] for line in generate_latest(vm.exposed).decode().splitlines()
               if line and not line.startswith("#")}
    assert not set(VLLM_DASHBOARD_NAMES) - exposed, set(VLLM_DASHBOARD_NAMES) - exposed
    assert not [n for n in exposed if n.startswith("kvmosaic:")]
    assert "vllm:num_requests_waiting_by_reason" in exposed
