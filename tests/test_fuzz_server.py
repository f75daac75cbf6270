"""Fuzzing a real server with schemathesis (issue 25, item 2), from the server's own OpenAPI
schema (``/openapi.json``: the request models' JSON schemas): thousands of generated bodies,
valid by the schema (positive) and not (negative), while a streaming victim and
``/health/live`` pings run beside them.

Holds: every answer is 2xx or 4xx, never 5xx; every 4xx is in OpenAI's error shape; no
traceback in the server's log; the server is up and its pool idle afterwards; the victim's
longest gap between two chunks and the longest ping stay under ``BOUND_S``.

One server process, and ``--replicas 2`` (the front and two Ray Serve replicas: the same checks
through the router). Slow (minutes each): ``pytest -m slow tests/test_fuzz_server.py``. Accepted (positive) bodies are
capped at ``MAX_NEW_TOKENS`` completion tokens so that a thousand of them fit a CPU run; the
caps and checks of the schema itself are fuzzed as generated.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from kvmosaic.server.launch import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = 500  # per (operation, mode): 2 operations x 2 modes = 2,000 generated requests
OTHER_EXAMPLES = 10  # per other operation (/v1/models, /health, ...)
MAX_NEW_TOKENS = 8
BOUND_S = 1.0
ERROR_KEYS = {"message", "type", "param", "code"}


class Beside:
    """A streaming victim (one long completion after another) and ``/health/live`` pings in a
    process of their own (``stream_victim.py``), so that what they measure is the server, not this
    process's request generator; their figures are read when the block ends."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.gaps: list[float] = []  # between two chunks of one stream
        self.first: list[float] = []  # request sent to first chunk
        self.pings: list[float] = []
        self.streams = 0
        self.errors: list[str] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Beside:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stream_victim.py")), self.url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("", timeout=120)  # stdin closed: it stops and reports
        if not out:
            raise RuntimeError(f"the victim's process exited with {self.proc.returncode} and no figures")
        figures = json.loads(out)
        self.gaps, self.first, self.pings = figures["gaps"], figures["first"], figures["pings"]
        self.streams, self.errors = figures["streams"], figures["errors"]


def cap_new_tokens(case) -> None:
    """Positive bodies only: short completions (the schema allows up to the whole context)."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_NEW_TOKENS:
                body[key] = MAX_NEW_TOKENS
        if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_NEW_TOKENS
        if "prompt" in body and "max_tokens" in body and body["max_tokens"] is None:
            body["max_tokens"] = MAX_NEW_TOKENS
        # Issue 21: n and lists of prompts multiply the sequences; a few keep a CPU run short.
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
        if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
            body["prompt"] = body["prompt"][:2]


def wait_idle(proc: ServerProcess, timeout: float = 60) -> list[dict]:
    """Every engine's /health once all are idle (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        hs = proc.pool_healths()
        if all(h["kv"]["num_used_blocks"] == 0 and h["requests"] == {"running": 0, "waiting": 0} for h in hs) \
                or time.monotonic() > deadline:
            return hs
        time.sleep(0.5)


@pytest.mark.parametrize("mode", [[], ["--replicas", "2"]], ids=["one-process", "replicas-2"])
def test_schemathesis_against_a_real_server(mode):
    with ServerProcess("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", *mode) as proc:
        schema = schemathesis.openapi.from_url(proc.url + "/openapi.json")
        raw = httpx.get(proc.url + "/openapi.json").json()
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert raw["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]

        statuses: collections.Counter = collections.Counter()
        failures: list[str] = []
        session = requests.Session()

        def run(operation, mode, examples: int) -> None:
            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), derandomize=True)
            @given(operation.as_strategy(generation_mode=mode))
            def one(case) -> None:
                if mode == schemathesis.GenerationMode.POSITIVE:
                    cap_new_tokens(case)
                try:
                    r = case.call(base_url=proc.url, session=session, timeout=60)
                except Exception as e:  # noqa: BLE001 - a dropped connection is a finding too
                    statuses["no answer"] += 1
                    failures.append(f"{operation.label} {mode.value}: no answer ({type(e).__name__}: {e})")
                    return
                statuses[r.status_code] += 1
                where = f"{operation.label} {mode.value} {r.status_code}: body {str(case.body)[:200]!r}"
                if r.status_code >= 500:
                    failures.append(f"{where} -> {r.text[:300]}")
                elif r.status_code >= 400:
                    try:
                        err = r.json()["error"]
                        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"]
                    except Exception:  # noqa: BLE001
                        failures.append(f"{where}: not in OpenAI's error shape: {r.text[:300]}")

            one()

        t0 = time.perf_counter()
        with Beside(proc.url) as beside:
            time.sleep(1.0)  # the victim is streaming
            for operation in schema.get_all_operations():
                op = operation.ok()
                main = op.path in ("/v1/completions", "/v1/chat/completions")
                for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                    if main or mode == schemathesis.GenerationMode.POSITIVE:
                        run(op, mode, EXAMPLES if main else OTHER_EXAMPLES)
        elapsed = time.perf_counter() - t0
        total = sum(statuses.values())
        longest_gap = max(beside.gaps, default=float("nan"))
        longest_ping = max(beside.pings, default=float("nan"))
        print(f"\nschemathesis: {total} requests in {elapsed:.0f} s; statuses {dict(sorted(statuses.items(), key=str))}; "
              f"victim: {beside.streams} streams, longest gap {longest_gap:.3f} s, longest first chunk "
              f"{max(beside.first, default=float('nan')):.3f} s; /health/live: {len(beside.pings)} pings, longest "
              f"{longest_ping:.3f} s")

        assert total >= 2000, total
        assert not failures, f"{len(failures)} failures, first: " + "\n".join(failures[:10])
        assert not beside.errors, beside.errors[:5]
        assert proc.alive()
        assert "Traceback" not in proc.output(), proc.output()[-3000:]
        healths = wait_idle(proc)
        assert all(h["kv"]["num_used_blocks"] == 0 for h in healths), healths
        assert beside.gaps and longest_gap <= BOUND_S, f"victim's longest gap {longest_gap:.3f} s"
        assert longest_ping <= BOUND_S, f"longest /health/live {longest_ping:.3f} s"
