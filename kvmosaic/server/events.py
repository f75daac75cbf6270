"""Cache events on the wire, as vLLM sends its KV events, and a subscriber for routers.

Why ZeroMQ PUB/SUB: it is what vLLM uses, so routers that follow vLLM replicas (llm-d's KV
cache indexer, Dynamo's router) can follow ours; it needs no broker to run (no Redis, no
Kafka); any number of routers may subscribe; and publishing never blocks the engine: a slow
subscriber past the high-water mark loses messages instead of stalling decoding. Losses are
visible, because each message carries a sequence number, and repairable, because the
publisher keeps recent batches and replays them on request (a ROUTER socket, as vLLM does).

A message is three frames: ``topic``, an 8-byte big-endian sequence number, and a msgpack
:class:`KVEventBatch` (an array ``[ts, events, rank]`` of events encoded as maps tagged by class
name: the layout of current vLLM's ``vllm.distributed.kv_events``, whose own classes decode it;
test: ``tests/test_events_vllm.py``). Replay: send one frame, the 8-byte first
sequence number wanted, to the replay endpoint; the answer is ``(seq, payload)`` pairs from
there on, then ``(-1, b"")``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from ..cache import events as cache_events

log = logging.getLogger("kvmosaic.server")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, gc=False, tag=True):
    """vLLM's layout (``vllm.distributed.kv_events``, 0.32 and 0.33): each event a msgpack map
    tagged ``"type": "<class name>"``; every field is sent, defaults included, so a decoder
    that requires a field (vLLM's ``lora_name``) always finds it."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # deprecated in vLLM for lora_name; kvmosaic's adapter id if an int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None  # not sent: they hold the tenant's salt
    group_idx: int | None = 0  # one KV cache group: full attention on every layer
    kv_cache_spec_kind: str | None = "full_attention"
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = 0


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """An array ``[ts, events, data_parallel_rank]``, as vLLM's ``EventBatch``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's earlier layout (before the tagged maps, up to 0.10): each event a msgpack array
    ``["<class name>", field, ...]`` with trailing defaults left out; ``--kv-events-format array``
    for consumers built against it."""


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None = None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


EVENT_FORMATS = ("vllm", "array")


def as_array_event(event: KVCacheEvent) -> ArrayEvent:
    if isinstance(event, BlockStored):
        return ArrayBlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                event.lora_id, event.medium)
    if isinstance(event, BlockRemoved):
        return ArrayBlockRemoved(event.block_hashes, event.medium)
    return ArrayAllBlocksCleared()


def is_loopback(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint stays on this machine (ipc, inproc, tcp on a loopback address)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def check_bind(endpoint: str, allow_remote: bool, authenticated: bool) -> None:
    """Refuse to publish cache events beyond loopback unless the operator allows it (they name
    every tenant's blocks); warn when they go out unauthenticated."""
    if is_loopback(endpoint):
        return
    if not allow_remote:
        raise ValueError(f"refusing to publish cache events on {endpoint} (not loopback): subscribers learn every "
                         "tenant's cached blocks; use tcp://127.0.0.1:PORT, or pass --kv-events-allow-remote "
                         "(and CURVE keys)")
    if not authenticated:
        log.warning("cache events on %s are readable by anyone who can connect (no CURVE keys)", endpoint)


def to_wire(event: cache_events.KVCacheEvent, include_token_ids: bool = True) -> KVCacheEvent:
    if isinstance(event, cache_events.BlockStored):
        token_ids = list(event.token_ids) if include_token_ids else []
        lora = event.lora_id
        return BlockStored(list(event.block_hashes), event.parent_block_hash, token_ids, event.block_size,
                           lora if isinstance(lora, int) else None, event.medium,
                           lora_name=lora if isinstance(lora, str) else None, group_idx=event.group_idx,
                           kv_cache_spec_kind=event.kv_cache_spec_kind,
                           kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)
    if isinstance(event, cache_events.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), event.medium, group_idx=event.group_idx)
    if isinstance(event, cache_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a cache event: {event!r}")


class ZmqEventPublisher:
    """Publishes batches from its own thread, which owns both sockets (ZeroMQ sockets are not
    thread-safe); :meth:`publish` only enqueues, so the engine thread never waits on I/O.
    Sequence numbers start at 0 and grow by one per batch. The only gaps at the source stand
    for events the engine's log dropped (``EventLog.max_pending``): such a sequence number is
    skipped and never replayed, so every subscriber sees the loss."""

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 buffer_batches: int = 10_000, hwm: int = 100_000, include_token_ids: bool = True,
                 allow_remote: bool = False, curve_secret_key: bytes | None = None,
                 curve_client_keys: list[bytes] | None = None, wire_format: str = "vllm") -> None:
        """``include_token_ids=False`` publishes hashes only. Endpoints must be loopback unless
        ``allow_remote``. ``curve_secret_key`` (Z85, from ``zmq.curve_keypair()``) makes both
        sockets CURVE servers; ``curve_client_keys`` (Z85 public keys) then lists the only
        subscribers let in (None: any client that knows the server's public key).
        ``wire_format``: "vllm" (current vLLM's tagged maps) or "array" (its earlier arrays)."""
        if wire_format not in EVENT_FORMATS:
            raise ValueError(f"unknown cache event format {wire_format!r}; choose one of {EVENT_FORMATS}")
        self.wire_format = wire_format
        for ep in (endpoint, replay_endpoint):
            if ep:
                check_bind(ep, allow_remote, curve_secret_key is not None)
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.include_token_ids = include_token_ids
        self._auth = None
        if curve_secret_key is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._ctx = zmq.Context()  # its own context: the authenticator applies to all of its sockets
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            allowed = None if curve_client_keys is None else {bytes(k) for k in curve_client_keys}

            class _Keys:
                def callback(self, domain: str, key: bytes) -> bool:  # key: the client's Z85 public key
                    return allowed is None or bytes(key) in allowed

            self._auth.configure_curve_callback("kvmosaic", _Keys())
        else:
            self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._curve(self._pub, curve_secret_key)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._curve(self._replay, curve_secret_key)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._pending: queue.SimpleQueue[list | int | None] = queue.SimpleQueue()
        self.num_skipped = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kvmosaic-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _curve(sock: zmq.Socket, secret: bytes | None) -> None:
        if secret is not None:
            sock.curve_secretkey = secret
            sock.curve_publickey = zmq.curve_public(secret)
            sock.curve_server = True
            sock.zap_domain = b"kvmosaic"

    def publish(self, events: list[cache_events.KVCacheEvent], dropped: int = 0) -> None:
        """Queue a batch; ``dropped`` > 0 (events lost before this batch) skips a number."""
        if dropped:
            self._pending.put(dropped)
        if events:
            self._pending.put(events)

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()

    def _send(self, events: list) -> None:
        wire = [to_wire(e, self.include_token_ids) for e in events]
        if self.wire_format == "array":
            batch = ArrayKVEventBatch(time.time(), [as_array_event(e) for e in wire])
        else:
            batch = KVEventBatch(time.time(), wire)
        payload = self._encoder.encode(batch)
        seq = self._seq.to_bytes(8, "big", signed=True)
        try:
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("cache event batch %d dropped (high-water mark)", self._seq)
        self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replay(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            client, *frames = self._replay.recv_multipart()
            start = int.from_bytes(frames[-1], "big", signed=True) if frames and len(frames[-1]) == 8 else 0
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big", signed=True), payload))
            self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _run(self) -> None:
        try:
            while True:
                try:
                    events = self._pending.get(timeout=0.05)
                except queue.Empty:
                    events = []
                if events is None:
                    return
                if isinstance(events, int):
                    log.warning("%d cache events were dropped; sequence number %d skipped", events, self._seq)
                    self._seq += 1
                    self.num_skipped += 1
                elif events:
                    self._send(events)
                self._serve_replay()
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)


class KVEventSubscriber:
    """Follows one replica's cache events, for a router.

    ``recv()`` returns the next ``(seq, batch)`` in order. When sequence numbers jump (messages
    lost on the way) and a replay endpoint is known, the missing batches are fetched first;
    without one, ``gaps`` counts what was lost, and the caller should treat its view of the
    replica as stale. :class:`CachedBlocks` turns the batches into a set of block hashes.
    """

    def __init__(self, endpoint: str, topic: str = "", replay_endpoint: str | None = None,
                 curve_server_key: bytes | None = None, curve_keypair: tuple[bytes, bytes] | None = None) -> None:
        """``curve_server_key`` (the publisher's Z85 public key) and ``curve_keypair``
        (this client's public, secret) connect to a CURVE-authenticated publisher."""
        self._ctx = zmq.Context.instance()
        self._curve_keys = (curve_server_key, curve_keypair or zmq.curve_keypair()) if curve_server_key else None
        self._sub = self._ctx.socket(zmq.SUB)
        self._client_curve(self._sub)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ready: deque[tuple[int, KVEventBatch]] = deque()
        self.next_seq: int | None = None
        self.gaps = 0

    def recv(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next batch, or None when none arrived within ``timeout`` seconds."""
        if not self._ready:
            if not self._sub.poll(None if timeout is None else int(timeout * 1000)):
                return None
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if self.next_seq is not None and seq > self.next_seq:
                self._fill(self.next_seq, seq)
            if self.next_seq is None or seq >= self.next_seq:
                self._ready.append((seq, self._decoder.decode(payload)))
        seq, batch = self._ready.popleft()
        self.next_seq = seq + 1
        return seq, batch

    def _fill(self, start: int, stop: int) -> None:
        got = self.replay(start, stop) if self.replay_endpoint else []
        self.gaps += (stop - start) - len(got)
        self._ready.extend(got)

    def replay(self, start: int, stop: int | None = None, timeout: float = 5.0) -> list[tuple[int, KVEventBatch]]:
        """Batches ``start <= seq < stop`` that the publisher still holds."""
        sock = self._ctx.socket(zmq.DEALER)
        self._client_curve(sock)
        sock.connect(self.replay_endpoint)
        out = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while sock.poll(int(timeout * 1000)):
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    break
                if stop is None or seq < stop:
                    out.append((seq, self._decoder.decode(payload)))
        finally:
            sock.close(linger=0)
        return out

    def _client_curve(self, sock: zmq.Socket) -> None:
        if self._curve_keys is not None:
            server, (public, secret) = self._curve_keys
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server, public, secret

    def close(self) -> None:
        self._sub.close(linger=0)


class CachedBlocks:
    """What one replica holds, as a router sees it: block hash -> parent hash."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    self.parent[h] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.parent.pop(h, None)
            else:
                self.parent.clear()

    def prefix_hits(self, chain: list[bytes]) -> int:
        """How many leading blocks of a request's hash chain this replica holds."""
        n = 0
        while n < len(chain) and chain[n] in self.parent:
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.parent)
