"""ZeroMQ sockets for the wire: one ROUTER per worker, one DEALER per (render, worker) pair.

Every socket gets a maximum message size (the kernel-side guard against a peer that
sends a huge frame), high-water marks, and linger 0 so a closing process never hangs on
unsent frames. The ROUTER is ROUTER_MANDATORY: sending to a full or vanished peer
raises instead of dropping silently, so the worker can keep coalescing and retry.
CURVE encryption is available for untrusted networks through `CurveKeys`.
"""

from __future__ import annotations

import ipaddress
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

from shared.protocol import MAX_FRAME_BYTES

DEFAULT_HWM = 10_000


class InsecureKeyFileError(PermissionError):
    """A CURVE secret key file that users other than its owner can read: refused, since
    whoever reads a secret key can pose as its owner (ssh refuses such keys too)."""

    def __init__(self, path: Path, mode: int) -> None:
        super().__init__(
            f"{path} is readable by other users (mode {mode:04o}); a CURVE secret key must "
            f"be private: run `chmod 600 {path}`"
        )


def check_secret_key_file(path: Path) -> None:
    """Raise `InsecureKeyFileError` if group or others may read ``path``."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        raise InsecureKeyFileError(path, mode)


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE key material. A server needs its secret key; a client also needs the
    server's public key. Keys come from files in `zmq.auth`'s certificate format, the
    secret one readable by its owner only."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes | None = None

    @classmethod
    def from_files(cls, secret_file: Path, server_public_file: Path | None = None) -> CurveKeys:
        import zmq.auth

        check_secret_key_file(secret_file)
        public, secret = zmq.auth.load_certificate(str(secret_file))
        if secret is None:
            raise ValueError(f"{secret_file} holds no secret key")
        server_public = None
        if server_public_file is not None:
            server_public, _ = zmq.auth.load_certificate(str(server_public_file))
        return cls(public, secret, server_public)


def _apply_common(socket: zmq.Socket, hwm: int, max_message_bytes: int) -> None:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


def make_router(
    context: zmq.Context,
    bind: str,
    *,
    curve: CurveKeys | None = None,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = MAX_FRAME_BYTES,
) -> zmq.Socket:
    """The worker's socket: bound, ROUTER_MANDATORY, ROUTER_HANDOVER, optional CURVE server.

    Handover: a render process that reconnects (a drained worker listed again, a dropped
    connection) does so under its own identity; without handover the router refuses the
    new connection while it still holds the old one, and the Hello sent on it is lost
    until the next one, a heartbeat timeout later."""
    socket = context.socket(zmq.ROUTER)
    _apply_common(socket, hwm, max_message_bytes)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if curve is not None:
        socket.curve_secretkey = curve.secret_key
        socket.curve_publickey = curve.public_key
        socket.curve_server = True
    socket.bind(bind)
    return socket


def make_dealer(
    context: zmq.Context,
    connect: str,
    *,
    identity: bytes | None = None,
    curve: CurveKeys | None = None,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = MAX_FRAME_BYTES,
) -> zmq.Socket:
    """A render process's socket to one worker."""
    socket = context.socket(zmq.DEALER)
    _apply_common(socket, hwm, max_message_bytes)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if connect.startswith("tcp://["):
        # A literal IPv6 address (e.g. an AAAA record found by discovery); ZMQ refuses
        # IPv6 unless asked, and asking for every address could prefer a v6 route.
        socket.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        if curve.server_public_key is None:
            raise ValueError("a CURVE client needs the server's public key")
        socket.curve_secretkey = curve.secret_key
        socket.curve_publickey = curve.public_key
        socket.curve_serverkey = curve.server_public_key
    socket.connect(connect)
    return socket


def bound_endpoint(socket: zmq.Socket) -> str:
    """The address a socket actually bound (resolves `tcp://127.0.0.1:*`)."""
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def is_local_bind(address: str) -> bool:
    """Whether only this machine can reach a bind address: ipc:// or inproc://, or tcp://
    on loopback. ``*``, an interface or a host name counts as reachable from outside."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return scheme in ("ipc", "inproc")
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
