"""``--segment-reuse auto`` through the real server: documents in chat messages, reordered and
unmarked, are found again for the tenant that sent them and for no other; usage and /metrics
report it (issue 24), with the shadow audit's measured drift. On one process and through
``--replicas 2`` alike: the prefix-aware router keeps a tenant's prompts with a common head on the
replica that holds their chunks."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from kvmosaic.audit import Auditor
from kvmosaic.server.launch import ServerProcess
from tests.conftest import TEST_DEVICE

DOCS = [
    "Document A. The lighthouse on Gull Point was built in 1871 and painted red in 1902; its lamp was "
    "fuelled by whale oil until the harbour board bought an electric lamp from a firm in the capital.",
    "Document B. The ferry to Marsh Island leaves at seven and returns at four; in winter it runs only on "
    "Mondays and Thursdays, and passengers must book a seat at the harbour office the day before.",
    "Document C. The bakery on Quay Street sells rye bread on Tuesdays only, and on Fridays it bakes a "
    "plum cake whose recipe the owner's grandmother brought from the mountains ninety years ago.",
]
KEYS = {"a": {"Authorization": "Bearer key-a"}, "b": {"Authorization": "Bearer key-b"}}
ADMIN = {"Authorization": "Bearer admin-key"}
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module", params=[None, 2], ids=["one-process", "replicas-2"])
def server(request):
    args = ["--device", TEST_DEVICE, "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256",
            "--max-model-len", "1024",
            "--segment-reuse", "auto", "--auto-reuse-max-drift", "0.2", "--auto-reuse-audit-rate", "1",
            "--auto-reuse-audit-tokens", "3",
            "--api-key", "key-a", "--api-key", "key-b", "--admin-key", "admin-key"]
    proc = ServerProcess(*args, *(["--replicas", str(request.param)] if request.param else []))
    with proc.start():
        yield proc


def chat(server, docs, key="a", **extra) -> dict:
    content = "Answer from these documents.\n\n" + "\n\n".join(docs) + "\n\nWhen was the lighthouse built?"
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0.0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=KEYS[key], timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer admin-key"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def labels(server, name: str, label: str) -> set[str]:
    """The values of ``label`` on the samples of ``name`` that are above 0."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer admin-key"}, timeout=30).text
    return {line.split(f'{label}="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith(name + "{") and float(line.rsplit(" ", 1)[1]) > 0}


def test_reordered_documents_are_reused_for_their_tenant_only(server):
    first = chat(server, DOCS)
    assert first["auto_reused_tokens"] == 0 and first["auto_reuse_drift"] is None
    other = chat(server, DOCS[::-1], key="b")
    assert other["auto_reused_tokens"] == 0, "tenant b must not reuse what tenant a computed"
    again = chat(server, DOCS[::-1])
    assert again["auto_reused_tokens"] > 60 and again["auto_reuse_drift"] > 0
    assert again["auto_reuse_fallback"] is False
    assert metric(server, "kvmosaic:auto_reuse_tokens_total") >= again["auto_reused_tokens"]
    assert metric(server, "kvmosaic:auto_reuse_fallbacks_total") == 0
    repaired = again["auto_reuse_repaired_tokens"]  # recomputed beyond the ratio to meet the guard's bound
    assert repaired >= 0 and metric(server, "kvmosaic:auto_reuse_repaired_tokens_total") == repaired
    assert metric(server, "kvmosaic:auto_reuse_repairs_total") == (repaired > 0)
    # every answer from reused KV was audited against a full prefill (--auto-reuse-audit-rate 1)
    audits = metric(server, "kvmosaic:auto_reuse_audits_total")
    assert audits == metric(server, "kvmosaic:auto_reuse_requests_total") >= 1
    assert metric(server, "kvmosaic:auto_reuse_audit_kl_count") == audits
    assert audits <= metric(server, "kvmosaic:auto_reuse_audited_tokens_total") <= 3 * audits  # answers' first 3
    assert 0 < metric(server, "kvmosaic:auto_reuse_audit_kl_sum") < 0.2 * audits
    assert metric(server, "kvmosaic:auto_reuse_audits_failed_total") == 0
    assert metric(server, "kvmosaic:tenant_auto_reuse_audits_total") == audits  # all of them tenant a's
    assert len(labels(server, "kvmosaic:tenant_auto_reuse_audits_total", "tenant")) == 1
    assert all(h["kv"]["num_used_blocks"] == 0 for h in server.pool_healths(Authorization="Bearer admin-key"))


def test_a_streamed_request_reuses_and_reports_it_and_leaves_no_block_held(server):
    """Streaming: the chunks arrive, the final usage reports the reuse, and once the stream is done no
    block is left in use (the stores the engine defers past a step's outputs ran and let them go)."""
    chat(server, DOCS)  # stored for tenant a (on the replica the router keeps its head on)
    content = "Answer from these documents.\n\n" + "\n\n".join(DOCS[1:] + DOCS[:1]) + "\n\nWhen was the lighthouse built?"
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=KEYS["a"], timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chunks)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["auto_reused_tokens"] > 60
    assert all(h["kv"]["num_used_blocks"] == 0 for h in server.pool_healths(Authorization="Bearer admin-key"))


def test_the_audit_finds_no_cross_tenant_reuse_away_from_the_prefix(server, request):
    """``kvmosaic audit --head-tokens``: a secret behind a fresh head is reused for its own
    tenant (the oracle sees it) and never for another. Behind replicas only the second half:
    the router routes by prefix, and probes with fresh heads share none, so whether a tenant's
    probe meets its secret's replica is the load balancer's draw, not the cache's."""
    def audit(attacker: str):
        a = Auditor(server.url, attacker, "key-a", suffix=4, seed=1, head=24)
        return a.probe_length(96, probes=2, order_pairs=0)

    if "replicas" not in request.node.callspec.id:
        own = audit("key-a")
        assert own.cached_leak and own.cached_true > 0  # the same tenant: found by auto reuse
    other = audit("key-b")
    assert not other.cached_leak and other.cached_true == 0


def test_the_explorer_shows_automatic_reuse_as_the_metrics_count_it(server, request):
    """``/dashboard/state`` (one process, or merged over the replicas) carries automatic reuse's figures
    and its audit's record, equal to ``/metrics``; in a real browser the page shows them."""
    chat(server, DOCS)
    chat(server, DOCS[2:] + DOCS[:2])
    state = httpx.get(server.url + "/dashboard/state", headers=ADMIN, timeout=30).json()
    a = state["auto_reuse"]
    assert a["requests"] == metric(server, "kvmosaic:auto_reuse_requests_total") >= 1
    assert a["tokens"] == metric(server, "kvmosaic:auto_reuse_tokens_total")
    assert a["fallbacks"] == metric(server, "kvmosaic:auto_reuse_fallbacks_total")
    assert a["audits"] == metric(server, "kvmosaic:auto_reuse_audits_total") == a["requests"]
    assert a["over_bound"] == metric(server, "kvmosaic:auto_reuse_audits_over_bound_total")
    assert a["audited_tokens"] == metric(server, "kvmosaic:auto_reuse_audited_tokens_total")
    assert sum(a["kl"]["counts"]) == a["audits"]
    assert a["kl"]["sum"] == pytest.approx(metric(server, "kvmosaic:auto_reuse_audit_kl_sum"), rel=1e-6)
    assert sum(f["audits"] for f in a["tenants"].values()) == a["audits"] and len(a["tenants"]) == 1
    assert (a["bound"], a["audit_rate"], a["audit_tokens"]) == (0.2, 1.0, 3)
    if "replicas" in request.node.callspec.id or not os.path.exists(CHROMIUM):
        return
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_context(extra_http_headers=ADMIN).new_page()
            assert page.goto(server.url + "/dashboard").status == 200
            page.wait_for_function("Number(document.body.dataset.polls) >= 1", timeout=20_000)
            assert page.locator("#auto-section").is_visible()
            assert float(page.locator("#auto-audits").inner_text().replace(",", "")) == a["audits"]
            assert float(page.locator("#auto-requests").inner_text().replace(",", "")) == a["requests"]
            assert page.locator("#auto-tenant-table tbody tr").count() == 1
        finally:
            browser.close()


def test_a_request_bounds_its_own_drift_through_vllm_xargs(server):
    """vLLM's custom arguments: ``vllm_xargs.auto_reuse_max_drift`` 0 makes this request an exact prefill
    (nothing reused, though its chunks are stored); a bad value is a 400 naming it; keys this server does
    not read are carried, as vLLM carries them."""
    chat(server, DOCS)
    a, b, c = DOCS
    looked_up = metric(server, "kvmosaic:auto_reuse_requests_total")
    exact = chat(server, [a, c, b], vllm_xargs={"auto_reuse_max_drift": 0, "my_plugin_arg": [1, "x"]})
    assert exact["auto_reused_tokens"] == 0 and exact["auto_reuse_drift"] is None
    assert metric(server, "kvmosaic:auto_reuse_requests_total") == looked_up
    assert chat(server, [b, a, c])["auto_reused_tokens"] > 60  # another order, under the server's bound
    for bad in (-1, "0.1", True, {"x": 1}):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "vllm_xargs": {"auto_reuse_max_drift": bad}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=KEYS["a"], timeout=60)
        assert r.status_code == 400 and "auto_reuse_max_drift" in r.text, (bad, r.text)
