"""A stand-in gpu-worker with no model, to measure what one render process can stream.

A benchmark tool only: tests never use it as a substitute for the engine. It speaks the
real wire protocol (`shared.protocol`) on a real ROUTER socket (`shared.transport`):
`Hello` gets a `Welcome` whose ModelCard carries the real tokenizer's digest, so
`render-serve --worker ADDR` accepts it; `Generate` starts a stream of ordinary token ids
(a made-up paragraph, cycled) at a set pace; `Abort` stops it; a `Heartbeat` goes to every
client each second. Every tick it gives each running request `--tokens-per-tick` tokens
and sends one `Deltas` per client, as one engine step of a real worker would.

    python -m bench.serving.synthetic_worker --bind tcp://127.0.0.1:5599 --itl-ms 10

prints `synthetic-worker ready on ADDR` on stdout once bound.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass

import zmq

from shared.model_card import ModelCard
from shared.model_source import DEFAULT_MODEL, resolve_model
from shared.protocol import (
    Abort,
    Deltas,
    Encoder,
    Generate,
    Heartbeat,
    Hello,
    ProtocolError,
    Rejected,
    RenderMessageDecoder,
    RequestDelta,
    Welcome,
    WorkerStats,
)
from shared.transport import bound_endpoint, make_router

logger = logging.getLogger("synthetic_worker")

PARAGRAPH = (
    " The river town woke slowly. Bakers opened their shutters, a tram rattled over the"
    " bridge, and the market filled with crates of pears, onions and bright flowers."
    " Somewhere a radio played an old song about the sea, and nobody was in a hurry."
)
HEARTBEAT_INTERVAL_S = 1.0


@dataclass
class _Running:
    """One request being 'generated': who asked, and how many tokens are left."""

    client: bytes
    request_id: str
    num_prompt_tokens: int
    remaining: int
    position: int
    is_first: bool = True


class SyntheticWorker:
    """Emits token ids at a fixed pace per request, with no model behind them."""

    def __init__(
        self,
        bind: str,
        model_card: ModelCard,
        token_ids: list[int],
        *,
        itl_s: float,
        tokens_per_tick: int = 1,
        worker_id: str = "synthetic",
    ) -> None:
        self.model_card = model_card
        self.token_ids = token_ids
        self.itl_s = itl_s
        self.tokens_per_tick = tokens_per_tick
        self.worker_id = worker_id
        self._context = zmq.Context()
        self._router = make_router(self._context, bind)
        self.endpoint = bound_endpoint(self._router)
        self._encoder = Encoder()
        self._decoder = RenderMessageDecoder()
        self._clients: set[bytes] = set()
        self._running: dict[tuple[bytes, str], _Running] = {}
        # Deltas a full pipe refused, merged per request and retried next tick.
        self._unsent: dict[bytes, dict[str, RequestDelta]] = {}
        self._stopping = False
        self.steps = 0
        self.bad_frames = 0

    def stop(self) -> None:
        self._stopping = True

    def serve_forever(self) -> None:
        next_tick = time.monotonic() + self.itl_s
        next_heartbeat = time.monotonic()
        try:
            while not self._stopping:
                now = time.monotonic()
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + HEARTBEAT_INTERVAL_S
                active = bool(self._running or self._unsent)
                if not active:
                    next_tick = now + self.itl_s  # the first token comes one step after
                elif now >= next_tick:
                    self._tick()
                    # Keep the cadence; a tick that ran late does not cause a burst.
                    next_tick += self.itl_s
                    if next_tick < now:
                        next_tick = now + self.itl_s
                wake_at = min(next_tick, next_heartbeat) if active else next_heartbeat
                wait_ms = max(0.0, wake_at - time.monotonic()) * 1000
                if self._router.poll(math.ceil(wait_ms), zmq.POLLIN):
                    self._receive()
        finally:
            self._router.close()
            self._context.term()

    # ---- incoming -----------------------------------------------------------------------

    def _receive(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.bad_frames += 1
                continue
            identity, frame = frames
            try:
                message = self._decoder.decode(frame)
            except ProtocolError as exc:
                self.bad_frames += 1
                logger.warning("dropped a bad frame: %s", exc)
                continue
            if isinstance(message, Hello):
                self._clients.add(identity)
                welcome = Welcome(worker_id=self.worker_id, model_card=self.model_card)
                self._send(identity, welcome)
            elif identity not in self._clients:
                if isinstance(message, Generate):
                    self._send(
                        identity,
                        Rejected(
                            request_id=message.request_id,
                            code="protocol",
                            message="send Hello first",
                        ),
                    )
            elif isinstance(message, Generate):
                self._add(identity, message)
            elif isinstance(message, Abort):
                for request_id in message.request_ids:
                    self._running.pop((identity, request_id), None)
                    self._unsent.get(identity, {}).pop(request_id, None)

    def _add(self, identity: bytes, request: Generate) -> None:
        key = (identity, request.request_id)
        if key in self._running:
            return  # a retried Generate runs once, as on a real worker
        self._running[key] = _Running(
            client=identity,
            request_id=request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            remaining=request.sampling.max_tokens,
            position=hash(request.request_id) % len(self.token_ids),
        )

    # ---- outgoing -----------------------------------------------------------------------

    def _tick(self) -> None:
        """One 'engine step': every running request gets its next tokens."""
        self.steps += 1
        by_client: dict[bytes, dict[str, RequestDelta]] = {}
        finished: list[tuple[bytes, str]] = []
        cycle = self.token_ids
        for key, run in self._running.items():
            count = min(self.tokens_per_tick, run.remaining)
            new_ids = [cycle[(run.position + i) % len(cycle)] for i in range(count)]
            run.position += count
            run.remaining -= count
            delta = RequestDelta(request_id=run.request_id, new_token_ids=new_ids)
            if run.is_first:
                delta.num_prompt_tokens = run.num_prompt_tokens
                delta.queue_time = 0.0
                run.is_first = False
            if run.remaining == 0:
                delta.finish_reason = "length"
                finished.append(key)
            by_client.setdefault(run.client, {})[run.request_id] = delta
        for key in finished:
            del self._running[key]
        for identity, deltas in by_client.items():
            pending = self._unsent.pop(identity, None)
            if pending:
                for request_id, delta in deltas.items():
                    _merge_into(pending, request_id, delta)
                deltas = pending
            self._send_deltas(identity, deltas)
        for identity in [i for i in self._unsent if i not in by_client]:
            self._send_deltas(identity, self._unsent.pop(identity))

    def _send_deltas(self, identity: bytes, deltas: dict[str, RequestDelta]) -> None:
        message = Deltas(deltas=list(deltas.values()), step=self.steps)
        if not self._send(identity, message):
            self._unsent[identity] = deltas

    def _heartbeat(self) -> None:
        stats = WorkerStats(num_running=len(self._running), steps=self.steps)
        stats.bad_frames = self.bad_frames
        beat = Heartbeat(sent_at=time.time(), stats=stats)
        for identity in list(self._clients):
            self._send(identity, beat)

    def _send(self, identity: bytes, message: object) -> bool:
        """Send now; False when the client's pipe is full (ROUTER_MANDATORY: EAGAIN)."""
        try:
            self._router.send_multipart([identity, self._encoder.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget(identity)  # the client is gone: nobody will read its tokens
        return True

    def _forget(self, identity: bytes) -> None:
        self._clients.discard(identity)
        self._unsent.pop(identity, None)
        for key in [key for key in self._running if key[0] == identity]:
            del self._running[key]


def _merge_into(pending: dict[str, RequestDelta], request_id: str, new: RequestDelta) -> None:
    into = pending.get(request_id)
    if into is None:
        pending[request_id] = new
        return
    into.new_token_ids.extend(new.new_token_ids)
    into.finish_reason = new.finish_reason or into.finish_reason
    into.num_prompt_tokens = into.num_prompt_tokens or new.num_prompt_tokens


def build_model_card(model: str) -> tuple[ModelCard, list[int]]:
    """The card a real worker of `model` would send, and the token ids to cycle."""
    from render_server.templating.tokenizer import Tokenizer

    source = resolve_model(model)
    tokenizer = Tokenizer.from_source(source)
    card = ModelCard(
        model_id=source.name,
        tokenizer_digest=tokenizer.digest,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        max_model_len=tokenizer.max_model_len,
        architecture="synthetic",
    )
    return card, tokenizer.encode(PARAGRAPH, add_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="tcp://127.0.0.1:5599", help="ZMQ address to bind")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer card to claim")
    parser.add_argument(
        "--itl-ms", type=float, default=10.0, help="milliseconds between steps (per-request ITL)"
    )
    parser.add_argument("--tokens-per-tick", type=int, default=1, help="tokens per request/step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    card, token_ids = build_model_card(args.model)
    worker = SyntheticWorker(
        args.bind,
        card,
        token_ids,
        itl_s=args.itl_ms / 1000,
        tokens_per_tick=args.tokens_per_tick,
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop())
    print(f"synthetic-worker ready on {worker.endpoint}", flush=True)
    worker.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
