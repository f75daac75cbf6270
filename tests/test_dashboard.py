"""The cache explorer and live miss reasons against a real server (issue 23): the per-request
field stays in the caller's namespace, ``/dashboard`` is the admin's, the live explain changes
nothing, and in a real browser (Playwright driving Debian's chromium) the page under load shows
the figures ``/metrics`` and ``/health`` report, hides token text, and is saved as a screenshot."""

from __future__ import annotations

import base64
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvmosaic.server.launch import ServerProcess

ADMIN = {"Authorization": "Bearer admin-key"}
ARGS = ("--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "160", "--max-model-len", "512",
        "--block-size", "16", "--api-key", "key-a", "--api-key", "key-b", "--admin-key", "admin-key")
SECRET = "Zanzibar quartermaster pelican invoice"  # text no page may show without --dashboard-show-text
CHROMIUM = "/usr/bin/chromium"
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tier = tmp_path_factory.mktemp("disk-tier")
    s = ServerProcess(*ARGS, "--kv-tier", f"disk:{tier}:64MiB").start()  # write-through: blocks also on disk
    yield s
    s.stop()


def complete(server, key: str, prompt: str, miss: bool = True, salt: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "return_miss_reasons": miss}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_miss_reasons_stay_in_the_callers_namespace(server):
    prompt = f"{SECRET}. " + "Tell me about the harbour and its ships, one by one, in order. " * 3
    usage = complete(server, "key-a", prompt)
    first = usage["prompt_tokens_details"]
    assert sum(first["miss_reasons"].values()) == usage["prompt_tokens"] - first["cached_tokens"] > 0
    n = complete(server, "key-a", prompt)["prompt_tokens_details"]
    assert n["cached_tokens"] > 0 and set(n["miss_reasons"]) == {"partial_block"}
    b = complete(server, "key-b", prompt)["prompt_tokens_details"]
    assert "namespace" not in b["miss_reasons"]
    assert b["miss_reasons"] == first["miss_reasons"]  # as if key-a had never sent it
    assert "miss_reasons" not in complete(server, "key-b", prompt + " more", miss=False)["prompt_tokens_details"]
    m = httpx.get(server.url + "/metrics", headers=ADMIN).text
    assert metric(m, "kvmosaic:prefix_cache_miss_tokens_total", reason="namespace") > 0  # the admin sees it
    misses = sum(metric(m, "kvmosaic:prefix_cache_miss_tokens_total", reason=r) for r in
                 ("cold", "evicted", "tier_miss", "partial_block", "diverged", "namespace"))
    queries, hits = metric(m, "kvmosaic:prefix_cache_queries_total"), metric(m, "kvmosaic:prefix_cache_hits_total")
    assert misses + metric(m, "kvmosaic:prefix_cache_tier_hit_tokens_total") == queries - hits
    assert len(re.findall(r'kvmosaic:tenant_prefix_cache_queries_total\{[^}]*tenant="t-[0-9a-f]{12}"', m)) == 2


def test_audit_finds_no_cross_tenant_information_in_miss_reasons(server):
    from kvmosaic.audit import Auditor

    auditor = Auditor(server.url, "key-a", "key-b", suffix=2, seed=3)
    for res in auditor.run([32], probes=4, order_pairs=0):
        assert res.miss_auc is not None and res.miss_auc <= 0.6 and not res.namespace_shown, res
        assert not res.cached_leak


def test_dashboard_is_the_admins(server):
    for path in ("/dashboard", "/dashboard/state"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer key-a"}).status_code == 403
        assert httpx.get(server.url + path, headers=ADMIN).status_code == 200
        basic = "Basic " + base64.b64encode(b"admin:admin-key").decode()
        assert httpx.get(server.url + path, headers={"Authorization": basic}).status_code == 200
    r = httpx.post(server.url + "/dashboard/explain", json={"prompt": "x"}, headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 403
    page = httpx.get(server.url + "/dashboard", headers=ADMIN)
    assert len(page.content) <= 300_000 and "http://" not in page.text and "https://" not in page.text


def _load(server, stop: threading.Event, sent: list) -> None:
    i = 0
    while not stop.is_set():
        key = ("key-a", "key-b")[i % 2]
        head = SECRET if i % 3 == 0 else "A short note about gardens"
        complete(server, key, f"{head}. Question {i % 5}: what grows in spring in a garden by the sea?", miss=False)
        sent.append(i)
        i += 1


def _text(page, sel: str) -> str:
    return page.locator(sel).inner_text().strip()


def _num(s: str) -> float:
    return float(s.replace(",", ""))


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (scripts/setup.sh)")
def test_the_page_in_a_real_browser(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    stop, sent = threading.Event(), []
    loaders = [threading.Thread(target=_load, args=(server, stop, sent)) for _ in range(2)]
    for t in loaders:
        t.start()
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                tenant = browser.new_context(extra_http_headers={"Authorization": "Bearer key-a"})
                assert tenant.new_page().goto(server.url + "/dashboard").status == 403
                ctx = browser.new_context(extra_http_headers=ADMIN, viewport={"width": 1400, "height": 1100})
                page = ctx.new_page()
                t0 = time.perf_counter()
                assert page.goto(server.url + "/dashboard").status == 200
                page.wait_for_function("document.body.dataset.firstRenderMs !== undefined", timeout=10_000)
                first_render_s = time.perf_counter() - t0
                page.wait_for_function("Number(document.body.dataset.polls) >= 3", timeout=20_000)
                while len(sent) < 6:
                    time.sleep(0.2)
            finally:
                stop.set()
                for t in loaders:
                    t.join()
            time.sleep(0.2)  # quiescent: every request answered, nothing runs
            polls = int(page.evaluate("document.body.dataset.polls"))
            page.wait_for_function(f"Number(document.body.dataset.polls) >= {polls + 2}", timeout=10_000)
            m = httpx.get(server.url + "/metrics", headers=ADMIN).text
            health = httpx.get(server.url + "/health", headers=ADMIN).json()
            assert _num(_text(page, "#queries")) == metric(m, "kvmosaic:prefix_cache_queries_total")
            assert _num(_text(page, "#hits")) == metric(m, "kvmosaic:prefix_cache_hits_total")
            for reason in ("cold", "evicted", "tier_miss", "partial_block", "diverged", "namespace"):
                shown = _num(_text(page, f"td.miss-{reason}"))
                assert shown == metric(m, "kvmosaic:prefix_cache_miss_tokens_total", reason=reason), reason
            assert _num(_text(page, "#num-blocks")) == health["kv"]["num_blocks"]
            assert _num(_text(page, "#free-blocks")) == health["kv"]["num_free_blocks"]
            assert _num(_text(page, "#cached-blocks")) == health["kv"]["num_cached_blocks"]
            for row in page.locator("#tenant-table tbody tr").all():
                label = row.get_attribute("data-tenant")
                cells = [c.inner_text() for c in row.locator("td").all()]
                assert _num(cells[2]) == metric(m, "kvmosaic:tenant_prefix_cache_queries_total", tenant=label)
            html = page.content()
            assert "Zanzibar" not in html and "quartermaster" not in html  # no token text without the flag
            page.fill("#probe-text", f"{SECRET}. Question 1: what grows in spring in a garden by the sea?")
            page.fill("#probe-key", "key-a")
            page.click("#probe-go")
            page.wait_for_function("document.querySelectorAll('#probe-table tbody tr').length > 0", timeout=10_000)
            page.wait_for_timeout(1200)
            # docs/dashboard.png is refreshed on request only: a test run leaves the checkout as it was
            shot = DOCS / "dashboard.png" if os.environ.get("KVMOSAIC_UPDATE_DOCS") == "1" else tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            weight = len(httpx.get(server.url + "/dashboard", headers=ADMIN).content)
            print(f"\npage weight {weight} bytes; first render {first_render_s:.2f} s "
                  f"(in page {page.evaluate('document.body.dataset.firstRenderMs')} ms) under load")
            # the target is 1 s on a loaded 2-core server (BENCHMARKS.md); the test guards at 2 s, as
            # the machine it runs on is shared and its load is not ours to set
            assert weight <= 300_000 and float(page.evaluate("document.body.dataset.firstRenderMs")) <= 2000
            browser.close()
    finally:
        stop.set()
        for t in loaders:
            t.join()


def _static(state: dict) -> dict:
    """What a read must not change (ages move with the clock)."""
    return {"blocks": state["blocks"], "counters": state["counters"], "kv": state["kv"], "tenants": state["tenants"],
            "prefixes": [{k: v for k, v in n.items() if k != "last_use_s"} for n in state["prefixes"]]}


def test_live_explain_reads_only(server):
    prompt = "The lighthouse keeper counted the waves every night and wrote them down. " * 4
    complete(server, "key-a", prompt)
    before = httpx.get(server.url + "/dashboard/state", headers=ADMIN).json()
    metrics_before = httpx.get(server.url + "/metrics", headers=ADMIN).text
    r = httpx.post(server.url + "/dashboard/explain", headers=ADMIN,
                   json={"prompt": prompt + " And then?", "api_key": "key-a"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["pool_tokens"] >= 48 and got["blocks"][0]["where"] == "pool"
    assert got["blocks"][-1]["where"] == "computed" and got["stop"]["reason"] in ("cold", "partial_block")
    other = httpx.post(server.url + "/dashboard/explain", headers=ADMIN, json={"prompt": prompt, "api_key": "key-b"}).json()
    assert other["pool_tokens"] == 0 and "namespace" in other["missed"]  # the admin sees why
    after = httpx.get(server.url + "/dashboard/state", headers=ADMIN).json()
    assert _static(after) == _static(before)
    families = ("kvmosaic:prefix", "kvmosaic:kv_cache", "kvmosaic:tenant", "kvmosaic:kv_tier")
    keep = [ln for ln in metrics_before.splitlines() if ln.startswith(families)]
    now = httpx.get(server.url + "/metrics", headers=ADMIN).text.splitlines()
    assert [ln for ln in now if ln.startswith(families)] == keep
    # the pool forgets, the disk tier still holds the blocks: the probe says so, and counts no lookup
    assert httpx.post(server.url + "/reset_prefix_cache", headers=ADMIN).status_code == 200
    tiers_before = [ln for ln in httpx.get(server.url + "/metrics", headers=ADMIN).text.splitlines()
                    if ln.startswith("kvmosaic:kv_tier")]
    got = httpx.post(server.url + "/dashboard/explain", headers=ADMIN, json={"prompt": prompt, "api_key": "key-a"}).json()
    assert got["pool_tokens"] == 0 and got["tier_tokens"] >= 48 and got["blocks"][0]["where"] not in ("pool", "computed")
    assert [ln for ln in httpx.get(server.url + "/metrics", headers=ADMIN).text.splitlines()
            if ln.startswith("kvmosaic:kv_tier")] == tiers_before
    usage = complete(server, "key-a", prompt)["prompt_tokens_details"]  # now loaded from the tier
    assert usage["cached_tokens"] >= 48 and set(usage["miss_reasons"]) <= {"partial_block"}

@pytest.mark.slow
def test_the_explorer_through_replicas():
    """``--replicas 2``: the front's page state sums the replicas' (equal to the merged
    ``/metrics`` summed over ``replica``), labels prefixes by replica and records the routes."""
    with ServerProcess(*ARGS, "--replicas", "2") as front:
        for i in range(6):
            complete(front, ("key-a", "key-b")[i % 2], f"Replica check {i % 3}: the tide tables for the week ahead.")
        assert httpx.get(front.url + "/dashboard", headers={"Authorization": "Bearer key-a"}).status_code == 403
        assert httpx.get(front.url + "/dashboard", headers=ADMIN).status_code == 200
        state = httpx.get(front.url + "/dashboard/state", headers=ADMIN, timeout=60).json()
        m = httpx.get(front.url + "/metrics", headers=ADMIN, timeout=60).text
        assert len(state["replicas"]) == 2 and len(state["routes"]) == 6
        assert {r["replica"] for r in state["routes"]} <= set(state["replicas"])
        assert state["counters"]["queries"] == metric(m, "kvmosaic:prefix_cache_queries_total")
        for reason, n in state["counters"]["miss_tokens"].items():
            assert n == metric(m, "kvmosaic:prefix_cache_miss_tokens_total", reason=reason), reason
        assert all(p["replica"] in state["replicas"] for p in state["prefixes"])
        got = httpx.post(front.url + "/dashboard/explain", headers=ADMIN, timeout=60,
                         json={"prompt": "Replica check 1: the tide tables for the week ahead.", "api_key": "key-b"}).json()
        assert got["replica"] in state["replicas"] and set(got["per_replica"]) == set(state["replicas"])
