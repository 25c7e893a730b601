"""ROUTER/DEALER helpers over real loopback sockets, with and without CURVE."""

from __future__ import annotations

import os

import pytest
import zmq
import zmq.auth

from shared.protocol import Encoder, Hello, RenderMessageDecoder
from shared.transport import CurveKeys, bound_endpoint, make_dealer, make_router


def _exchange(router: zmq.Socket, dealer: zmq.Socket) -> None:
    dealer.send(Encoder().encode(Hello(client_id="t")))
    assert router.poll(5000), "router got nothing"
    identity, frame = router.recv_multipart()
    assert RenderMessageDecoder().decode(frame) == Hello(client_id="t")
    router.send_multipart([identity, b"pong"])
    assert dealer.poll(5000)
    assert dealer.recv() == b"pong"


def test_router_dealer_round_trip() -> None:
    context = zmq.Context()
    router = make_router(context, "tcp://127.0.0.1:*")
    dealer = make_dealer(context, bound_endpoint(router), identity=b"render-1")
    try:
        _exchange(router, dealer)
        assert router.getsockopt(zmq.LINGER) == 0
        assert router.getsockopt(zmq.MAXMSGSIZE) > 0
    finally:
        dealer.close()
        router.close()
        context.term()


def test_router_mandatory_raises_for_unknown_peer() -> None:
    context = zmq.Context()
    router = make_router(context, "tcp://127.0.0.1:*")
    try:
        # ROUTER_MANDATORY refuses an unknown peer instead of dropping the message
        with pytest.raises(zmq.ZMQError) as caught:
            router.send_multipart([b"nobody", b"x"])
        assert caught.value.errno == zmq.EHOSTUNREACH
    finally:
        router.close()
        context.term()


def test_curve_encrypted_exchange(tmp_path) -> None:
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(tmp_path, name)
        os.chmod(secret, 0o600)  # CurveKeys refuses a secret key others can read
    server = CurveKeys.from_files(tmp_path / "server.key_secret")
    client = CurveKeys.from_files(tmp_path / "client.key_secret", tmp_path / "server.key")
    context = zmq.Context()
    router = make_router(context, "tcp://127.0.0.1:*", curve=server)
    dealer = make_dealer(context, bound_endpoint(router), curve=client)
    try:
        assert router.getsockopt(zmq.CURVE_SERVER) == 1
        _exchange(router, dealer)
    finally:
        dealer.close()
        router.close()
        context.term()
