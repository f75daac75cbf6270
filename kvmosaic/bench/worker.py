"""Each peer lives in its own worker process (same process tree): its memory is its own, and
the coordinator sends it one request at a time, so peers never run at the same moment.

Protocol over a pipe: ``("generate", ids, max_tokens)``, ``("generate_many", [ids, ...], max_tokens)``
(peers with ``generate_many``: all submitted together), ``("reset",)``, ``("peak",)`` (peak
RSS over the pre-load baseline since the last ``reset``), ``("stop",)``. Replies are
``("ok", value)`` or ``("error", traceback)``.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import asdict

from .memory import PeakRSS, rss_bytes
from .peers import Generation, PeerSettings, import_libraries, make_peer


def serve(name: str, settings: PeerSettings, conn) -> None:
    try:
        import_libraries(name)
        baseline = rss_bytes()
        peer = make_peer(name, settings)
        conn.send(("ok", {"load_mb": (rss_bytes() - baseline) / 2**20}))
    except Exception:  # noqa: BLE001 - reported to the coordinator, which skips the peer
        conn.send(("error", traceback.format_exc()))
        return
    peak = 0
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "stop":
                return
            if msg[0] == "generate":
                with PeakRSS() as mem:
                    gen = peer.generate(msg[1], msg[2])
                peak = max(peak, mem.peak - baseline)
                conn.send(("ok", asdict(gen)))
            elif msg[0] == "generate_many":
                with PeakRSS() as mem:
                    gens = peer.generate_many(msg[1], msg[2])
                peak = max(peak, mem.peak - baseline)
                conn.send(("ok", {"generations": [asdict(g) for g in gens], "steps": getattr(peer, "steps", None)}))
            elif msg[0] == "reset":
                peer.reset()
                peak = 0
                conn.send(("ok", None))
            elif msg[0] == "peak":
                conn.send(("ok", peak / 2**20))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class PeerProcess:
    """The coordinator's handle on one worker."""

    def __init__(self, name: str, settings: PeerSettings) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(name, settings, child), daemon=True, name=f"bench-{name}")
        self.process.start()
        child.close()
        self.load_info: dict | None = None

    def wait_ready(self) -> dict:
        self.load_info = self._reply()
        return self.load_info

    def _reply(self):
        if not self.conn.poll(timeout=3600):
            raise RuntimeError(f"{self.name}: no reply from the worker")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        self.conn.send(("generate", list(prompt_ids), max_tokens))
        return Generation(**self._reply())

    def generate_many(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Generation], list[dict] | None]:
        """All ``prompts`` submitted together; also the peer's per-step log when it keeps one."""
        self.conn.send(("generate_many", [list(p) for p in prompts], max_tokens))
        reply = self._reply()
        return [Generation(**g) for g in reply["generations"]], reply["steps"]

    def reset(self) -> None:
        self.conn.send(("reset",))
        self._reply()

    def peak_mb(self) -> float:
        self.conn.send(("peak",))
        return self._reply()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
