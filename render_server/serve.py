"""Running the render server: build the app, say where it listens, and serve it under
uvicorn, draining on SIGTERM. Used by `render-serve` (render_server.cli) and by each
process of `render-serve --processes N` (render_server.processes)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from uvicorn.config import LOG_LEVELS

from render_server.settings import RenderSettings
from shared.model_source import ModelNotFoundError

if TYPE_CHECKING:
    from fastapi import FastAPI

PROG = "render-serve"


def fail(message: str) -> NoReturn:
    """Exit 2 with the reason, as argparse does for a bad flag."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def configure_logging(settings: RenderSettings) -> None:
    """Log to stderr; with several processes each line names its process id."""
    process = "[%(process)d] " if settings.processes > 1 else ""
    logging.basicConfig(
        level=LOG_LEVELS[settings.log_level],
        format=f"%(asctime)s %(levelname)s {process}%(name)s: %(message)s",
    )


def build_app(settings: RenderSettings) -> FastAPI:
    """The app; a bad model, tokenizer or template exits 2 with the reason."""
    from render_server.http.app import create_app
    from render_server.templating.tokenizer import TokenizerLoadError

    try:
        return create_app(settings)
    except ModelNotFoundError as exc:
        fail(str(exc))
    except TokenizerLoadError as exc:
        fail(f"cannot load the tokenizer of {settings.model!r}: {exc}")
    except OSError as exc:
        fail(f"cannot read {exc.filename or 'a file'}: {exc.strerror or exc}")


def announce(settings: RenderSettings, port: int, processes: int = 1) -> None:
    """The one line that tells where the server listens."""
    scheme_host = f"[{settings.host}]" if ":" in settings.host else settings.host
    across = f" ({processes} processes)" if processes > 1 else ""
    print(
        f"{PROG}: serving {settings.served_model_name or settings.model} on "
        f"http://{scheme_host}:{port}{settings.root_path}/v1{across}",
        file=sys.stderr,
        flush=True,
    )


def serve_app(
    settings: RenderSettings, app: FastAPI, sockets: list[socket.socket] | None = None
) -> bool:
    """Run `app` under a DrainingServer until it exits; on `sockets` already bound (by the
    --processes supervisor) or else on settings.host/port. Returns whether it started."""
    from render_server.http.connection import http_protocol

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        root_path=settings.root_path,
        # "auto" picks uvloop (in the `render` extra) when importable.
        loop="auto",
        # httptools with the header limit and the header / body timeouts applied while
        # the bytes arrive (see http/connection.py).
        http=http_protocol(settings),
        lifespan="on",
        log_config=None,  # logging.basicConfig above already routes uvicorn's loggers
        log_level=LOG_LEVELS[settings.log_level],
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.timeout_graceful_shutdown_s,
        timeout_keep_alive=settings.timeout_keep_alive_s,
        server_header=False,
    )
    state = app.state.render
    from render_server.http.endpoint import stop_generations

    server = DrainingServer(
        config,
        state.admission,
        settings.drain_timeout_s,
        stop_remaining=lambda: stop_generations(state.live_generations),
    )
    # Everything built so far (the app, the tokenizer, imported modules) lives for the
    # whole process: out of the collector's sight, a full collection under load costs
    # ~0 ms instead of ~80 ms of stalled event loop.
    gc.collect()
    gc.freeze()
    server.run(sockets=sockets)
    return server.started


# After the drain timeout, how long the stopped streams get to send their error event and
# terminator before the server closes their connections.
_STOPPED_STREAMS_GRACE_S = 2.0
_ACCEPTED_GRACE_S = 0.25
"""How long a drained process, its listeners closed, lets the connections it has already
accepted send their request (to be answered 503 "draining") before uvicorn's shutdown closes
the ones still silent."""


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM: /ready turns 503 and new generation
    requests are refused (so a load balancer moves on), in-flight streams get up to
    `drain_timeout_s` to finish, then the server exits 0. The requests still running then
    are stopped first: each stream ends with an error event and its terminator, each
    other request with a 503, rather than a cut connection. A second signal exits at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        admission: Any,
        drain_timeout_s: float,
        stop_remaining: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self._admission = admission
        self._drain_timeout_s = drain_timeout_s
        self._stop_remaining = stop_remaining
        self._draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._admission is None or sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._admission.draining = True
        logging.getLogger(__name__).info(
            "SIGTERM: draining %d in-flight requests (up to %.0fs)",
            self._admission.in_flight,
            self._drain_timeout_s,
        )
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        finished = await self._admission.wait_idle(self._drain_timeout_s)
        if not finished:
            logging.getLogger(__name__).warning(
                "drain timeout: stopping the %d requests still in flight",
                self._admission.in_flight,
            )
            self._stop_remaining()
            await self._admission.wait_idle(_STOPPED_STREAMS_GRACE_S)
        await self._stop_accepting()
        self.should_exit = True

    async def _stop_accepting(self) -> None:
        """Close this process's listeners, then give the connections it accepted last a
        moment to be answered. uvicorn's shutdown closes a connection that has not sent its
        request yet, which its client sees as a cut connection rather than the 503; with
        --processes the socket is shared, so once this process stops accepting, a sibling
        still draining answers the new connections."""
        for server in self.servers:
            server.close()
        await asyncio.sleep(_ACCEPTED_GRACE_S)


def serve(settings: RenderSettings) -> None:
    """One process: build the app, say where it listens, serve until it exits."""
    app = build_app(settings)
    announce(settings, settings.port)
    serve_app(settings, app)
