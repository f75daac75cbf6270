"""SIGTERM on ``kvmosaic serve --replicas 2`` drains as one server does (issue 20): with 8
streams running, new requests get 503 with ``Retry-After``; streams that can finish within
``--shutdown-timeout`` finish; the rest end with an explicit error event and ``[DONE]``; none
is cut silently. Then Serve and the Ray it started shut down: no process of its tree is left.
A bad engine option ends the command the same way, before anything is deployed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from kvmosaic.server.launch import ServerProcess, free_port

C = "/v1/completions"


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One stream's fate: its text, whether it ended with [DONE], its error event if any."""
    text, done, error = "", False, None
    try:
        async with client.stream("POST", url + C, json={**body, "stream": True}, timeout=120) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev["error"]
                else:
                    text += ev["choices"][0]["text"]
    except httpx.HTTPError as e:  # a connection cut: silent unless an error event came first
        return {"text": text, "done": False, "error": error, "cut": repr(e)}
    return {"text": text, "done": done, "error": error, "cut": None}


def assert_gone(pids, within_s: float) -> None:
    """None of ``pids`` is running (a zombie is gone) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [psutil.Process(p).cmdline()[:2] for p in left]


def test_sigterm_with_8_streams_cuts_none_silently_and_leaves_no_ray_process():
    proc = ServerProcess("--replicas", "2", "--dtype", "float32", "--num-kv-blocks", "256",
                         "--max-model-len", "1024", "--shutdown-timeout", "3").start()
    try:
        deadline = time.monotonic() + 60  # the driver handles signals once Serve reports the app up
        while "Send it a request" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        tree = [p.pid for p in psutil.Process(proc.proc.pid).children(recursive=True)]
        assert tree, "Ray's processes are children of the driver"

        async def go():
            async with httpx.AsyncClient() as c:
                long = [asyncio.create_task(stream(c, proc.url, {"prompt": f"Story {i}: once upon a time",
                                                                 "max_tokens": 600, "ignore_eos": True}))
                        for i in range(6)]
                short = [asyncio.create_task(stream(c, proc.url, {"prompt": f"Count {i}: one, two,",
                                                                  "max_tokens": 8})) for i in range(2)]
                await asyncio.sleep(2.0)
                proc.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                async with httpx.AsyncClient() as fresh:  # not a pooled keep-alive connection
                    refused = await fresh.post(proc.url + C, json={"prompt": "late", "max_tokens": 2}, timeout=30)
                return refused, await asyncio.gather(*long), await asyncio.gather(*short)

        refused, long, short = asyncio.run(go())
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert all(s["done"] and s["error"] is None and s["text"] for s in short), short
        for s in long:  # 600 tokens do not fit in 3 s: each ends with the shutdown error, then [DONE]
            assert s["cut"] is None and s["done"] and s["error"]["code"] == "shutdown", s
        proc.proc.wait(timeout=90)
        assert_gone(tree, 20)
    finally:
        proc.stop()


def test_a_bad_engine_option_ends_the_command_and_leaves_no_ray_process():
    """The engine options are checked while Ray starts (serve/cli.py): a bad one ends ``kvmosaic
    serve --replicas 2`` with the check's message and exit status 1 before Serve starts, and the
    Ray it started shuts down with it."""
    proc = subprocess.Popen([sys.executable, "-m", "kvmosaic.cli", "serve", "--replicas", "2", "--block-size", "12",
                             "--port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    output = proc.communicate()[0]
    assert proc.returncode == 1, output[-3000:]
    assert "kvmosaic serve: error: block_size must be a power of two, got 12" in output
    assert "Application 'kvmosaic'" not in output  # nothing was deployed
    assert_gone(seen, 30)
