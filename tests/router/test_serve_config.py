"""The README's Serve-config route (issue 20): Ray's own ``serve run config.yaml`` with
``import_path: kvmosaic.serve.app:build_app`` and ``args:`` runs kvmosaic's replicas, API keys
and all; ``build_app`` is a Serve application builder (one args dict)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from kvmosaic.server.launch import free_port

CONFIG = """\
proxy_location: EveryNode
http_options:
  host: 127.0.0.1
  port: {port}
applications:
  - name: kvmosaic
    route_prefix: /
    import_path: kvmosaic.serve.app:build_app
    args:
      replicas: 2
      router: cache-aware
      dtype: float32
      num_kv_blocks: 128
      api_key: [key-a, key-b]
"""


def test_serve_run_with_a_config_file(tmp_path):
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG.format(port=port))
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([serve_cli, "run", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer key-a"}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        assert r.headers["x-kvmosaic-replica"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # serve run shuts the app and its local Ray down on Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
