"""The rest of vLLM v1's metrics (``vllm/v1/metrics/loggers.py``), under vLLM's names and units,
beside the counters of :mod:`.metrics`; and ``--metrics-prefix``.

Per request, observed once when it finishes (vLLM's ``FinishedRequestStats``; an aborted request
is observed with the phases it reached, a failed one not at all):
``request_queue_time_seconds`` (arrival -> first scheduled), ``request_prefill_time_seconds``
(first scheduled -> first token), ``request_decode_time_seconds`` (first -> last token),
``request_inference_time_seconds`` (first scheduled -> last token),
``request_time_per_output_token_seconds`` (decode time / (tokens - 1)),
``inter_token_latency_seconds`` (each gap between two output tokens),
``request_prompt_tokens`` / ``request_generation_tokens`` / ``request_prefill_kv_computed_tokens``
/ ``request_params_n`` / ``request_params_max_tokens`` / ``request_max_num_generation_tokens``,
``prompt_tokens_cached_total`` and ``prompt_tokens_by_source_total{source}`` (vLLM's sources:
``local_cache_hit`` (the pool, and reused segments), ``external_kv_transfer`` (storage tiers),
``local_compute``). Per engine step: ``iteration_tokens_total`` (tokens scheduled).

At scrape time, from the engine's snapshot: ``cache_config_info`` (a gauge fixed at 1 whose labels
are the cache's configuration), ``external_prefix_cache_queries`` / ``_hits`` (tokens looked up in /
supplied by the storage tiers, vLLM's KV-connector cache), the sampled residency histograms
``kv_block_lifetime_seconds``, ``kv_block_idle_before_evict_seconds``, ``kv_block_reuse_gap_seconds``,
and the tier counters in both units, each named for its unit (``kv_tier_queries_blocks`` /
``_tokens``, ``kv_tier_hits_blocks`` / ``_tokens``).

vLLM's deprecated names that its example Grafana dashboard still reads:
``time_per_output_token_seconds`` (= ``inter_token_latency_seconds``) and
``gpu_cache_usage_perc`` (= ``kv_cache_usage_perc``).

Our own: ``time_to_first_token_by_cache_seconds{cache="hit"|"miss"}`` (TTFT of requests that
found any cached prompt token, and of those that found none).

Every family whose name starts with ``kvmosaic:`` is exposed under the configured prefix
(:class:`PrefixedCollector`): ``--metrics-prefix vllm:`` makes a vLLM dashboard work unchanged.
Invariant: renaming happens at exposition only, so the collectors, the counts and the replicas'
merge (serve/metrics_merge.py) are the same whatever the prefix.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.output_processor import RequestOutput
from ..engine.stats import EngineStats, ModelInfo
from .metrics import PREFIX, TTFT_BUCKETS, ServerMetrics

PREFIX_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def check_prefix(prefix: str) -> str:
    if not PREFIX_RE.match(prefix) or not prefix.endswith(":"):
        raise ValueError(f"metrics prefix {prefix!r} must be a Prometheus name ending in ':' (e.g. 'vllm:')")
    return prefix


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, e = [], 0
    while True:
        for m in (1, 2, 5):
            if m * 10 ** e > max_value:
                return out
            out.append(m * 10 ** e)
        e += 1


class PrefixedCollector(Collector):
    """Everything ``inner`` collects, with a leading ``kvmosaic:`` replaced by ``prefix``."""

    def __init__(self, inner: CollectorRegistry, prefix: str) -> None:
        self.inner, self.prefix = inner, check_prefix(prefix)

    def collect(self) -> Iterator[Metric]:
        for m in self.inner.collect():
            if self.prefix == PREFIX or not m.name.startswith(PREFIX):
                yield m
                continue
            out = Metric(self.prefix + m.name[len(PREFIX):], m.documentation, m.type, m.unit)
            out.samples = [s._replace(name=self.prefix + s.name[len(PREFIX):]) for s in m.samples]
            yield out


class VllmMetrics:
    """vLLM's per-request and per-step histograms, registered into ``metrics.registry``, and
    the scrape-time collector of :func:`scrape_metrics`. ``exposed`` is the registry /metrics
    serves (the prefix applied)."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], EngineStats], info: ModelInfo,
                 prefix: str = PREFIX, config_labels: dict[str, str] | None = None) -> None:
        reg, self.model_name = metrics.registry, metrics.model_name
        lab = ["model_name"]
        tokens = build_1_2_5_buckets(info.max_model_len)

        def hist(name: str, doc: str, buckets, labels=lab) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg)

        self.queue = hist("request_queue_time_seconds", "Time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "time_per_output_token_seconds per request.",
                         TOKEN_LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        # vLLM's earlier name for the same observations, which its example dashboard still reads
        self.itl_alias = hist("time_per_output_token_seconds", "Inter-token latency in seconds (deprecated name "
                              "of inter_token_latency_seconds).", TOKEN_LATENCY_BUCKETS)
        self.prompt = hist("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation = hist("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.computed = hist("request_prefill_kv_computed_tokens",
                             "New KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.max_gen = hist("request_max_num_generation_tokens",
                            "Maximum number of requested generation tokens.", tokens)
        self.params_n = hist("request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.", tokens)
        self.iteration = hist("iteration_tokens_total", "Number of tokens per engine_step.", ITERATION_BUCKETS)
        self.ttft_by_cache = hist("time_to_first_token_by_cache_seconds",
                                  "Time to first token, by whether the prompt hit the cache (hit: any cached "
                                  "token).", TTFT_BUCKETS, lab + ["cache"])
        self.cached = Counter(PREFIX + "prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                              lab, registry=reg)
        self.by_source = Counter(PREFIX + "prompt_tokens_by_source", "Number of prompt tokens by source.",
                                 lab + ["source"], registry=reg)
        for source in SOURCES:  # every series present from the start, as vLLM's
            self.by_source.labels(self.model_name, source)
        for cache in ("hit", "miss"):
            self.ttft_by_cache.labels(self.model_name, cache)
        reg.register(ScrapeCollector(stats, info, self.model_name, config_labels or {}))
        self.exposed = CollectorRegistry()
        self.exposed.register(PrefixedCollector(reg, prefix))

    def on_iteration(self, num_tokens: int) -> None:
        self.iteration.labels(self.model_name).observe(num_tokens)

    def on_finish(self, out: RequestOutput) -> None:
        """Once per request (engine thread); a failed request is not observed."""
        m, name = out.metrics, self.model_name
        if out.finish_reason == "error" or "finish_time" not in m:
            return
        arrival, sched, first, last = (m.get(k) for k in ("arrival_time", "first_scheduled_time",
                                                            "first_token_time", "last_token_time"))
        if sched is not None:
            self.queue.labels(name).observe(sched - arrival)
        if first is None:
            return  # aborted before its first token: no prefill or decode phase to observe
        self.prefill.labels(name).observe(first - sched)
        self.decode.labels(name).observe(last - first)
        self.inference.labels(name).observe(last - sched)
        n_gen = len(out.token_ids)
        if n_gen > 1:
            self.tpot.labels(name).observe((last - first) / (n_gen - 1))
        for gap in m.get("itl", ()):
            self.itl.labels(name).observe(gap)
            self.itl_alias.labels(name).observe(gap)
        self.generation.labels(name).observe(n_gen)
        self.max_gen.labels(name).observe(m["max_tokens"])
        self.params_max_tokens.labels(name).observe(m["max_tokens"])
        if out.parent_request_id is not None:
            return  # a forked sample: its prompt was its parent's (counted once, there)
        self.params_n.labels(name).observe(m["n"])
        n_prompt, tier = len(out.prompt_token_ids), m.get("num_tier_tokens", 0)
        hit = out.num_cached_tokens + out.num_segment_tokens
        computed = max(0, n_prompt - hit)
        self.prompt.labels(name).observe(n_prompt)
        self.computed.labels(name).observe(computed)
        self.cached.labels(name).inc(hit)
        for source, n in zip(SOURCES, (computed, hit - tier, tier)):
            self.by_source.labels(name, source).inc(max(0, n))
        if m.get("ttft") is not None:
            self.ttft_by_cache.labels(name, "hit" if hit else "miss").observe(m["ttft"])


class ScrapeCollector(Collector):
    """Read at scrape time from the engine's snapshot (see :mod:`.metrics`)."""

    def __init__(self, stats: Callable[[], EngineStats], info: ModelInfo, model_name: str,
                 config_labels: dict[str, str]) -> None:
        self.stats, self.info, self.model_name = stats, info, model_name
        self.config = {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_kv_blocks),
                       "cache_dtype": info.dtype, "enable_prefix_caching": str(info.prefix_cache != "none"),
                       "prefix_caching_hash_algo": info.hash_algo, "prefix_cache": info.prefix_cache,
                       **config_labels}

    def collect(self) -> Iterator[Metric]:
        st, name = self.stats(), self.model_name
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self.config))
        info.add_metric(list(self.config.values()), 1.0)
        yield info
        usage = GaugeMetricFamily(PREFIX + "gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                                  "(deprecated name of kv_cache_usage_perc).", labels=["model_name"])
        usage.add_metric([name], st.kv_cache_usage)
        yield usage
        waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason", "Waiting requests by reason: "
                                    "capacity (queued for a slot, budget or blocks), deferred (loading KV "
                                    "from a storage tier).", labels=["model_name", "reason"])
        waiting.add_metric([name, "capacity"], st.num_waiting)
        waiting.add_metric([name, "deferred"], st.num_waiting_for_kv)
        yield waiting
        yield from residency_metrics(st.kv_residency or {}, name)
        yield from tier_unit_metrics((st.kv_tiers or {}).get("tiers", {}), self.info.block_size, name)


def residency_metrics(res: dict, model_name: str) -> Iterator[Metric]:
    from ..cache.residency import RESIDENCY_BUCKETS

    docs = {"lifetime": "KV cache block lifetime from allocation to eviction (sampled).",
            "idle_before_evict": "Idle time before KV cache block eviction (sampled).",
            "reuse_gap": "Time gaps between consecutive KV cache block accesses (sampled)."}
    for key, doc in docs.items():
        if key not in res:
            continue
        h = HistogramMetricFamily(f"{PREFIX}kv_block_{key}_seconds", doc, labels=["model_name"])
        cum, buckets = 0, []
        for bound, n in zip([*map(str, map(float, RESIDENCY_BUCKETS)), "+Inf"], res[key]["buckets"]):
            cum += n
            buckets.append((bound, cum))
        h.add_metric([model_name], buckets, res[key]["sum"])
        yield h


def tier_unit_metrics(tiers: dict, block_size: int, model_name: str) -> Iterator[Metric]:
    """Per storage tier, lookups and hits in blocks and in tokens (a tier holds full blocks only);
    summed over the tiers, vLLM's ``external_prefix_cache_queries`` / ``_hits`` (tokens)."""
    labels = ["model_name", "tier", "medium"]
    fams = {
        "queries_blocks": ("Blocks looked up in the tier.", lambda s: s.get("queries", 0)),
        "queries_tokens": ("Tokens looked up in the tier (blocks x block size).",
                           lambda s: s.get("queries", 0) * block_size),
        "hits_blocks": ("Blocks the tier supplied to requests.", lambda s: s.get("hit_tokens", 0) // block_size),
        "hits_tokens": ("Prompt tokens the tier supplied to requests.", lambda s: s.get("hit_tokens", 0)),
    }
    for suffix, (doc, value) in fams.items():
        m = CounterMetricFamily(f"{PREFIX}kv_tier_{suffix}", doc, labels=labels)
        for tier, s in tiers.items():
            m.add_metric([model_name, tier, s["medium"]], value(s))
        yield m
    for name, key, doc in (
            ("external_prefix_cache_queries", "queries",
             "External prefix cache (storage tiers) queries, in terms of number of queried tokens."),
            ("external_prefix_cache_hits", "hit_tokens",
             "External prefix cache (storage tiers) hits, in terms of number of cached tokens.")):
        m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        scale = block_size if key == "queries" else 1
        m.add_metric([model_name], sum(s.get(key, 0) for s in tiers.values()) * scale)
        yield m


def attach(engine, metrics: ServerMetrics, prefix: str = PREFIX) -> VllmMetrics:
    """Build :class:`VllmMetrics` for an :class:`~.async_engine.AsyncEngine` and chain its hooks
    after the ones already set (``engine.on_finish``; the engine's ``on_iteration``)."""
    eng = engine.engine
    # the tiers' kinds only: a spec may hold a password (redis://user:pass@host)
    labels = {"kv_tiers": ",".join(t.split(":", 1)[0] for t in eng.config.kv_tiers or []) or "none",
              "kv_cache_metrics_sample": str(eng.config.kv_cache_metrics_sample)}
    vm = VllmMetrics(metrics, lambda: engine.stats, eng.model_info, prefix, labels)
    previous = engine.on_finish

    def on_finish(out: RequestOutput) -> None:
        previous(out)
        vm.on_finish(out)

    engine.on_finish = on_finish
    eng.on_iteration = vm.on_iteration
    return vm
