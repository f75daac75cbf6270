"""A streaming victim and ``/health/live`` pings, in a process of their own, for the tests that
check that no request stalls the others (``test_fuzz_server``).

Its own process: beside the test's request generator in one interpreter, the victim measured
the generator's turns at the GIL (gaps of 0.3–0.5 s with no request in flight) as much as the
server's. ``python tests/stream_victim.py URL`` streams one long completion after another and
pings every 50 ms until its stdin closes, then prints one JSON object: ``gaps`` (seconds between
two chunks of one stream), ``first`` (request sent to first chunk), ``pings`` (each ping's
seconds), ``streams`` (finished streams), ``errors``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

BODY = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 120, "ignore_eos": True, "stream": True}


class Victim:
    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.gaps: list[float] = []
        self.first: list[float] = []
        self.pings: list[float] = []
        self.streams = 0
        self.errors: list[str] = []

    def stream(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                sent, last = time.perf_counter(), None
                try:
                    with c.stream("POST", self.url + "/v1/completions", json=BODY) as r:
                        if r.status_code != 200:
                            self.errors.append(f"victim got {r.status_code}")
                            return
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            now = time.perf_counter()
                            if last is None:
                                self.first.append(now - sent)
                            else:
                                self.gaps.append(now - last)
                            last = now
                            if self.stop.is_set():
                                break
                    self.streams += 1
                except httpx.HTTPError as e:
                    self.errors.append(f"victim: {type(e).__name__}: {e}")
                    return

    def ping(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get(self.url + "/health/live").status_code == 200
                except httpx.HTTPError as e:
                    self.errors.append(f"ping: {type(e).__name__}")
                    ok = False
                self.pings.append(time.perf_counter() - t)
                if not ok:
                    self.errors.append("ping failed")
                time.sleep(0.05)


def main(url: str) -> None:
    victim = Victim(url)
    threads = [threading.Thread(target=victim.stream), threading.Thread(target=victim.ping)]
    for t in threads:
        t.start()
    sys.stdin.read()  # until the test closes it
    victim.stop.set()
    for t in threads:
        t.join()
    print(json.dumps({"gaps": victim.gaps, "first": victim.first, "pings": victim.pings,
                      "streams": victim.streams, "errors": victim.errors}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
