"""`gpu-worker-probe`: exit 0 if a gpu-worker answers Hello with Welcome, else 1.

For Kubernetes exec probes (readiness and liveness of worker pods) and scripts. It speaks
the real protocol, so a worker that accepts connections but whose engine loop is stuck
(no Welcome) fails the probe. Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

import zmq

from shared.curve import render_keys
from shared.protocol import Encoder, Hello, ProtocolError, Welcome, WorkerMessageDecoder
from shared.transport import make_dealer


def probe(address: str, timeout_s: float, curve_dir: str | None = None) -> str | None:
    """None if the worker welcomed us in time, else what went wrong."""
    context = zmq.Context()
    curve = render_keys(Path(curve_dir)) if curve_dir else None
    socket = make_dealer(context, address, identity=uuid.uuid4().bytes, curve=curve)
    try:
        socket.send(Encoder().encode(Hello(client_id="probe")))
        decoder = WorkerMessageDecoder()
        deadline_ms = int(timeout_s * 1000)
        while socket.poll(deadline_ms):
            try:
                message = decoder.decode(socket.recv())
            except ProtocolError as exc:
                return f"bad frame: {exc}"
            if isinstance(message, Welcome):
                return None
        return f"no Welcome from {address} within {timeout_s:g}s"
    finally:
        socket.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-worker-probe", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", default="tcp://127.0.0.1:5555", help="the worker's ZMQ address"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for Welcome")
    parser.add_argument("--zmq-curve-dir", default=None, help="CURVE keys, as for render-serve")
    args = parser.parse_args(argv)
    problem = probe(args.address, args.timeout, args.zmq_curve_dir)
    if problem is not None:
        print(f"gpu-worker-probe: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
