"""deploy/: a real Prometheus (Debian's package, installed by scripts/setup.sh) scrapes a real
server with the shipped scrape config, and every expression of the shipped Grafana dashboard
returns data (a finite value) through Prometheus's HTTP API.

The traffic makes every panel meaningful: a pool of 24 blocks and four ~10-block prompts in
turn, each twice in a row: the pool evicts (pool evictions, sampled block residency, reuse
gaps of blocks hit before eviction), the host tier supplies evicted prefixes back (hits by
tier), and first requests miss while repeats hit (TTFT split).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvmosaic.server.launch import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvmosaic-cache.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
if PROMETHEUS is None:  # scripts/setup.sh installs it; say so loudly rather than skip
    pytest.fail("no prometheus binary found: run scripts/setup.sh (Debian's 'prometheus' package)", pytrace=False)

TOPICS = ("the weather in the mountains", "a recipe for bread", "the history of clocks", "how bridges stand")


def dashboard_exprs(prefix: str = "kvmosaic:") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana's variables filled in as Grafana would
    (``$__rate_interval``: at least four scrape intervals)."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel["targets"]:
            expr = (t["expr"].replace("${prefix}", prefix).replace("$model_name", ".*")
                    .replace("$__rate_interval", "1m"))
            assert "$" not in expr, f"an unfilled variable in {panel['title']!r}: {expr}"
            out.append((panel["title"], expr))
    return out


@pytest.fixture(scope="module")
def prometheus_and_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prom")
    server = ServerProcess("--num-kv-blocks", "24", "--max-model-len", "384", "--dtype", "float32",
                           "--kv-tier", "host:16MiB", "--kv-cache-metrics-sample", "1")
    with server.start():
        config = SCRAPE_CONFIG.read_text()
        assert "127.0.0.1:8000" in config and "scrape_interval: 5s" in config  # what we patch below
        config = config.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}").replace(
            "scrape_interval: 5s", "scrape_interval: 1s")
        (tmp / "prometheus.yml").write_text(config)
        port = free_port()
        log = open(tmp / "prometheus.log", "w")
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
                time.sleep(0.2)
            yield url, server
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=30).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]


def test_every_dashboard_expression_returns_data(prometheus_and_server):
    url, server = prometheus_and_server
    deadline = time.monotonic() + 20
    while not query(url, 'up{job="kvmosaic"} == 1'):  # a first scrape before any traffic: rates see it all
        assert time.monotonic() < deadline, "Prometheus never scraped the server"
        time.sleep(0.3)
    for i in range(12):  # each topic twice in a row (a pool hit), then again after eviction (a tier hit)
        topic = TOPICS[i // 2 % 4]
        prompt = f"Tell me about {topic}. " + f"Here is more about {topic}, at length. " * 14
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=120)
        assert r.status_code == 200, r.text
    time.sleep(2.5)  # two more scrapes: the last counts are in
    assert query(url, 'up{job="kvmosaic"}')[0]["value"][1] == "1"
    empty = []
    for title, expr in dashboard_exprs():
        values = [float(s["value"][1]) for s in query(url, expr)]
        if not any(math.isfinite(v) for v in values):
            empty.append((title, expr, values))
    assert not empty, "dashboard expressions without data:\n" + "\n".join(map(str, empty))
    # the split the dashboard exists for: both a hit and a miss TTFT, and tier hits by name
    ttft = query(url, "sum by (cache) (kvmosaic:time_to_first_token_by_cache_seconds_count)")
    assert {s["metric"]["cache"]: float(s["value"][1]) > 0 for s in ttft} == {"hit": True, "miss": True}
    assert float(query(url, 'sum(kvmosaic:kv_tier_hits_tokens_total{tier="host"})')[0]["value"][1]) > 0
    assert float(query(url, "sum(kvmosaic:kv_block_lifetime_seconds_count)")[0]["value"][1]) > 0


def test_dashboard_uses_only_exposed_names(prometheus_and_server):
    """Every metric name the dashboard reads is one the server exposes (a renamed metric fails here
    even where an expression would quietly return nothing)."""
    url, server = prometheus_and_server
    exposed = set(re.findall(r"^(kvmosaic:[a-z_:]+?)(?:_bucket|_sum|_count)?[{ ]", httpx.get(
        server.url + "/metrics", timeout=30).text, re.M))
    names = {n for _, e in dashboard_exprs() for n in re.findall(r"kvmosaic:[a-z_]+", e)}
    missing = {n for n in names if n.removesuffix("_bucket") not in exposed and n not in exposed}
    assert not missing, missing
