"""Two tenants against real servers (one process per mode), with the official openai client:
in ``isolated`` and ``shared-public`` no answer to tenant B depends on what tenant A cached
(usage, events); in ``shared`` the audit detects the leak; admin endpoints and credentials.
The ``isolated`` tests run again through ``--replicas 2`` (Ray Serve): the same server."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest

from kvmosaic.audit import Auditor
from kvmosaic.server.events import BlockStored, KVEventSubscriber
from kvmosaic.server.launch import ServerProcess, free_port

BLOCK = 16
# Three processes share two cores: one torch thread each (several oversubscribe and crawl), a small pool.
COMMON = ("--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "96", "--max-model-len", "512",
          "--block-size", str(BLOCK),
          "--api-key", "key-a", "--api-key", "key-b", "--admin-key", "admin-key")
PUBLIC_TEXT = ("You are the support assistant of a hardware store. Answer briefly and politely. Opening hours "
               "are nine to six, Monday to Saturday; returns are accepted for thirty days with a receipt.")


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def cached(server, key: str, prompt, salt: str | None = None) -> int:
    r = client(server, key).completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0.0,
                                                extra_body={"cache_salt": salt} if salt else None)
    return r.usage.prompt_tokens_details.cached_tokens


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


_STARTED: dict[str, ServerProcess] = {}


def _start_all(public_file: str) -> None:
    """Start the three servers at once (model loading overlaps), once per session."""
    if _STARTED:
        return
    events = free_port()
    procs = {"isolated": ServerProcess(*COMMON, "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                                       "--kv-events-no-token-ids"),
             "shared-public": ServerProcess(*COMMON, "--tenancy", "shared-public", "--public-prefix-file",
                                            public_file, "--prefix-cache", "radix"),
             "shared": ServerProcess(*COMMON, "--tenancy", "shared")}
    procs["isolated"].events = f"tcp://127.0.0.1:{events}"
    errors = []

    def go(p: ServerProcess) -> None:
        try:
            finish(p)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(p,)) for p in procs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in procs.values():
            p.stop()
        raise errors[0]
    _STARTED.update(procs)


def finish(proc: ServerProcess) -> ServerProcess:
    proc.start()
    r = httpx.get(proc.url + "/v1/models", headers={"Authorization": "Bearer key-a"}, timeout=60)
    assert r.status_code == 200, f"/v1/models answered {r.status_code}: {r.text}\n{proc.output()[-3000:]}"
    proc.model = r.json()["data"][0]["id"]
    return proc


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    f = tmp_path_factory.mktemp("public") / "public.txt"
    f.write_text(PUBLIC_TEXT + "\n")
    _start_all(str(f))
    try:
        yield _STARTED
    finally:
        for p in _STARTED.values():
            p.stop()
        _STARTED.clear()


@pytest.fixture(scope="module")
def isolated_replicas():
    with ServerProcess(*COMMON, "--replicas", "2") as proc:
        yield finish(proc)


@pytest.fixture(scope="module", params=["one-process", "replicas-2"])
def isolated(request, servers):
    if request.param == "one-process":
        return servers["isolated"]
    return request.getfixturevalue("isolated_replicas")


@pytest.fixture(scope="module")
def shared_public(servers):
    return servers["shared-public"]


def test_isolated_b_never_sees_a(isolated):
    sub = KVEventSubscriber(isolated.events) if hasattr(isolated, "events") else None
    time.sleep(0.3)
    secret = ids(1, 80)
    assert cached(isolated, "key-a", secret) == 0
    assert cached(isolated, "key-a", secret) >= 64, "a tenant reuses its own prompt"
    assert cached(isolated, "key-b", secret) == 0, "tenant B learns nothing of A's cached prompt"
    assert cached(isolated, "key-b", secret) >= 64
    if sub is None:  # replicas publish for the router only
        return
    stored = []
    while (got := sub.recv(timeout=1.0)) is not None:
        stored += [e for e in got[1].events if isinstance(e, BlockStored)]
    sub.close()
    assert stored and all(e.token_ids == [] for e in stored), "events carry hashes, not token ids"


def test_admin_endpoints_need_the_admin_key(isolated):
    url = isolated.url
    tenant, admin = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer admin-key"}
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers=tenant).status_code == 403
    assert httpx.get(url + "/metrics", headers=admin).status_code == 200
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/health", headers=tenant).json() == {"status": "ok"}
    detailed = httpx.get(url + "/health", headers=admin).json()
    assert all("kv" in h for h in detailed.get("replicas", {"": detailed}).values())
    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    r = httpx.post(url + "/reset_prefix_cache", headers=tenant)
    assert r.status_code == 403 and "namespace" in r.json()["error"]["message"]
    assert httpx.post(url + "/reset_prefix_cache", headers=admin).status_code in (200, 409)


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/health", "/reset_prefix_cache"])
def test_malformed_bearer_is_401_not_500(isolated, path):
    for raw in ("Bearer \u00e9l\u00e8ve".encode(), b"Bearer \xff\xfe", b"Basic a2V5LWE="):
        r = httpx.request("POST" if path == "/reset_prefix_cache" else "GET", isolated.url + path,
                          headers=[(b"Authorization", raw)])
        if path == "/health":
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        else:
            assert r.status_code == 401, (path, raw, r.text)


def test_shared_public_shares_only_the_public_head(shared_public):
    secret_a = PUBLIC_TEXT + " Customer 4471 asked about the invoice for the oak table and the brass hinges."
    other = PUBLIC_TEXT + " A visitor wants to know whether we cut keys on Sundays, and how much it costs."
    assert cached(shared_public, "key-a", secret_a) == 0
    assert cached(shared_public, "key-a", secret_a) > 0
    # each probe in a fresh sub-namespace of B (body cache_salt), so B's own cache plays no part
    head_b_secret = cached(shared_public, "key-b", secret_a, "probe-1")
    head_b_other = cached(shared_public, "key-b", other, "probe-2")
    assert head_b_secret > 0, "the public system prompt is shared"
    assert head_b_secret == head_b_other, "B's usage does not depend on A's private tail"
    assert head_b_secret % BLOCK == 0, "only whole public blocks are shared"
    # a per-request marker: A declares a prefix public; B finds only what A declared
    marked = "Shared FAQ: we deliver within three days in town and charge ten euros for it. " * 3
    body = {"prompt": marked + "private question from A about order 99", "max_tokens": 1, "public_prefix": len(marked)}
    r = httpx.post(shared_public.url + "/v1/completions", headers={"Authorization": "Bearer key-a"}, json=body)
    assert r.status_code == 200, r.text
    body_b = {**body, "prompt": marked + "B asks something else entirely, about paint"}
    hb = httpx.post(shared_public.url + "/v1/completions", headers={"Authorization": "Bearer key-b"}, json=body_b)
    assert hb.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cached(shared_public, "key-b", marked + "B asks something else") == 0, "not declared by B: salted"


def test_a_truncated_prompt_has_no_public_head_left(shared_public, tokenizer):
    """vLLM's truncate_prompt_tokens cuts the prompt's head: the public head is found in what is
    left, so a prompt cut into its public part shares nothing (its blocks are salted)."""
    ids = tokenizer.encode(PUBLIC_TEXT + " A private note about invoice 5120.", add_special_tokens=False)
    body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": len(ids) - 3}

    def usage(key: str, salt: str | None = None) -> dict:
        r = httpx.post(shared_public.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={**body, **({"cache_salt": salt} if salt else {})}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = usage("key-a")
    assert first["prompt_tokens"] == len(ids) - 3
    assert usage("key-a")["prompt_tokens_details"]["cached_tokens"] > 0  # A's own namespace
    assert usage("key-b", "probe-truncated")["prompt_tokens_details"]["cached_tokens"] == 0


def test_shared_mode_audit_detects_the_leak(servers):
    auditor = Auditor(servers["shared"].url, "key-a", "key-b", suffix=2, seed=1)
    (res,) = auditor.run([32], probes=8, order_pairs=0)
    assert res.cached_leak and res.cached_true >= 32 and res.cached_wrong == 0
    # the timing channel: no leak gives an AUC near 0.5 (>= 0.8 by chance: p = 0.019 with 8 probes an
    # arm); one true probe slowed past every wrong one by a pause on a shared 2-core machine still passes
    # (0.875; with 6 probes such an outlier failed a CI run at 0.83)
    assert res.auc >= 0.8 and res.leaks()


def test_isolated_mode_audit_finds_no_cached_tokens_leak(isolated):
    auditor = Auditor(isolated.url, "key-a", "key-b", suffix=2, seed=2)
    (res,) = auditor.run([32], probes=4, order_pairs=0)
    assert not res.cached_leak and res.cached_true == 0
