"""Issue 13: the KV event and replay sockets under ZeroMQ CURVE, with real key pairs from
``zmq.curve_keypair()``. A client whose public key the publisher allows gets the live events
and the replay; a client with an unknown key, without CURVE, or that trusts the wrong server
key gets nothing within a timeout (the handshake is refused, no frame is delivered)."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
if not zmq.has("curve"):
    pytest.skip("libzmq built without CURVE", allow_module_level=True)

from kvmosaic.cache import events as ce  # noqa: E402
from kvmosaic.server.events import BlockStored, KVEventSubscriber, ZmqEventPublisher  # noqa: E402
from kvmosaic.server.launch import free_port  # noqa: E402

SECRET_TOKENS = [4471, 17, 9000, 23]


def stored(i: int) -> ce.BlockStored:
    return ce.BlockStored([bytes([i]) * 8], None, SECRET_TOKENS, 4)


@pytest.fixture
def curve_publisher():
    server_public, server_secret = zmq.curve_keypair()
    allowed = zmq.curve_keypair()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(pub_ep, replay_endpoint=replay_ep, curve_secret_key=server_secret,
                            curve_client_keys=[allowed[0]])
    yield pub, server_public, allowed, pub_ep, replay_ep
    pub.close()


def publish_until(pub: ZmqEventPublisher, sub: KVEventSubscriber, deadline_s: float = 10.0):
    """PUB/SUB drops what is sent before the subscription lands: publish until one arrives."""
    end, i = time.monotonic() + deadline_s, 0
    while time.monotonic() < end:
        pub.publish([stored(i)])
        i += 1
        got = sub.recv(timeout=0.2)
        if got is not None:
            return got
    return None


def test_an_allowed_client_gets_events_and_replay(curve_publisher):
    pub, server_public, allowed, pub_ep, replay_ep = curve_publisher
    sub = KVEventSubscriber(pub_ep, replay_endpoint=replay_ep, curve_server_key=server_public, curve_keypair=allowed)
    try:
        got = publish_until(pub, sub)
        assert got is not None, "an allowed CURVE client receives the live events"
        (event,) = got[1].events
        assert isinstance(event, BlockStored) and event.token_ids == SECRET_TOKENS
        replayed = sub.replay(0, timeout=5.0)
        assert replayed and [s for s, _ in replayed] == list(range(len(replayed))), "the replay answers it"
        assert replayed[0][1].events[0].token_ids == SECRET_TOKENS
    finally:
        sub.close()


@pytest.mark.parametrize("who", ["unknown-key", "no-curve", "wrong-server-key"])
def test_a_client_that_is_not_allowed_gets_nothing(curve_publisher, who):
    pub, server_public, allowed, pub_ep, replay_ep = curve_publisher
    # the allowed client proves that events flow while the other one listens
    ok = KVEventSubscriber(pub_ep, replay_endpoint=replay_ep, curve_server_key=server_public, curve_keypair=allowed)
    if who == "unknown-key":
        kw = {"curve_server_key": server_public, "curve_keypair": zmq.curve_keypair()}
    elif who == "wrong-server-key":
        kw = {"curve_server_key": zmq.curve_keypair()[0], "curve_keypair": allowed}
    else:
        kw = {}
    intruder = KVEventSubscriber(pub_ep, replay_endpoint=replay_ep, **kw)
    try:
        time.sleep(0.3)
        assert publish_until(pub, ok) is not None
        for i in range(5):
            pub.publish([stored(100 + i)])
        assert ok.recv(timeout=5.0) is not None
        assert intruder.recv(timeout=1.5) is None, f"{who}: no live event"
        assert intruder.replay(0, timeout=1.5) == [], f"{who}: no replay"
    finally:
        intruder.close()
        ok.close()
