"""Start ``kvmosaic serve`` (or another HTTP server's command) as a child process on a free
loopback port and wait until it answers: for tests, benchmarks and routers that need a real
replica or peer."""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 20000  # free_port picks from here up to the kernel's ephemeral range
_HANDED_OUT: set[int] = set()  # the ports free_port gave this process


def free_port() -> int:
    """A loopback port free now and, where the kernel says which ports it hands out to ``bind(0)``
    and outgoing connections, outside them: a port from ``bind(0)`` is given again to the next
    process that asks, and Ray starts dozens of processes that do while a replicas server starts
    (a test run saw Serve's front find its chosen port taken and fail). Never one it gave this
    process before: ports drawn for servers started together (and their events endpoints) are all
    free when drawn and none is bound yet (a CI run saw one of three servers started at once find
    its port taken)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.SystemRandom()
    for _ in range(64 if low > LOWEST_PORT else 0):
        port = rng.randrange(LOWEST_PORT, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``kvmosaic serve *serve_args``; or, with ``command``, any server's argv (``{port}`` filled
    in), ready once ``ready_path`` answers 200."""

    def __init__(self, *serve_args: str, port: int | None = None, command: list[str] | None = None,
                 ready_path: str = "/health") -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_path = ready_path
        if command is not None:
            self.args = [a.replace("{port}", str(self.port)) for a in command]
        else:
            self.args = [sys.executable, "-m", "kvmosaic.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(self.port), "--log-level", "warning", *serve_args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvmosaic-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Start the server and wait until it answers; a server already running is left as it is
        (starting it again would leave the first one running, unowned, on the same port)."""
        if self.alive():
            return self
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        # Its own session: whatever it started (Ray's raylet, GCS, actors) goes with it in stop().
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        _RUNNING.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a refused connection costs next to nothing; a start is ~10 s
        output = self.output()
        self.stop()
        raise TimeoutError(f"the server did not answer {self.ready_path} in {timeout} s:\n{output}")

    def health(self, **headers: str) -> dict:
        return httpx.get(self.url + "/health", headers=headers, timeout=30).json()

    def pool_healths(self, **headers: str) -> list[dict]:
        """Each engine's detailed ``/health`` (one; or, behind ``--replicas``, every replica's)."""
        h = self.health(**headers)
        return list(h["replicas"].values()) if "replicas" in h else [h]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM (the server drains, then stops Serve and Ray), SIGKILL after 60 s; then
        whatever is left of its session (a replica or Ray daemon the server did not get to stop)
        is killed, so that no test leaves processes behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)  # a drain, then (replicas) Serve and Ray shutting down
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            kill_session(self.proc.pid)
        _RUNNING.discard(self)
        self.log.close()
        with contextlib.suppress(FileNotFoundError):  # stopping twice is fine
            os.unlink(self.log.name)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_RUNNING: set[ServerProcess] = set()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (Linux ``/proc``; elsewhere nothing). Ray's actors
    run in process groups of their own, but in the session of the server that started Ray."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                session = int(f.read().rpartition(")")[2].split()[3])
            if session == sid:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


@atexit.register
def _stop_leftovers() -> None:
    """Servers a caller started and never stopped (a fixture whose teardown did not run) are
    stopped when the process exits, with everything they started."""
    for proc in list(_RUNNING):
        proc.stop()
