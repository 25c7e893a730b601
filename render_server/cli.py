"""`render-serve`: flags -> RenderSettings -> app -> uvicorn.

Flags override `DUET_*` environment variables, which override the defaults: only flags
actually given are passed to RenderSettings, the rest it reads from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from pydantic import ValidationError
from uvicorn.config import LOG_LEVELS

from render_server.settings import RenderSettings
from shared.cli_fields import add_fields, given_fields
from shared.model_source import ModelNotFoundError

if TYPE_CHECKING:
    from fastapi import FastAPI

PROG = "render-serve"


def build_parser() -> argparse.ArgumentParser:
    """The flags of render-serve: one per RenderSettings field, each also a DUET_* variable."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="duet's CPU render server: OpenAI-style HTTP front, chat templates and "
        "tokenization. Every flag can also be set as DUET_<NAME> in the environment.",
    )
    add_fields(parser, RenderSettings)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> RenderSettings:
    """Parse flags into RenderSettings; a bad value exits 2 with argparse's message.

    Only flags actually given reach RenderSettings, which reads the rest from `DUET_*`
    variables or its defaults: flags win over the environment, which wins over defaults."""
    parser = build_parser()
    given = given_fields(parser.parse_args(argv), RenderSettings)
    try:
        return RenderSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        parser.error(problems)


def _fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def configure_logging(settings: RenderSettings) -> None:
    """Log to stderr; with several processes each line names its process id."""
    process = "[%(process)d] " if settings.processes > 1 else ""
    logging.basicConfig(
        level=LOG_LEVELS[settings.log_level],
        format=f"%(asctime)s %(levelname)s {process}%(name)s: %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `render-serve`."""
    settings = parse_settings(argv)
    configure_logging(settings)
    # Imported here so `render-serve --help` stays instant.
    from render_server.templating.templates import read_chat_template
    from render_server.worker_client.embedded import EmbeddedWorker, EmbeddedWorkerError
    from shared.model_source import resolve_model

    embedded: EmbeddedWorker | None = None
    wants_embedded = not settings.workers and not settings.worker_dns and not settings.render_only
    if wants_embedded or settings.processes > 1:
        # Fail on a bad --model or template here, before a worker spends time loading
        # (or N processes each load a tokenizer to find out).
        try:
            resolve_model(settings.model)
            if settings.chat_template is not None:
                read_chat_template(settings.chat_template)
        except ModelNotFoundError as exc:
            _fail(str(exc))
        except OSError as exc:
            _fail(f"cannot read {exc.filename or 'a file'}: {exc.strerror or exc}")
    if wants_embedded:
        embedded = EmbeddedWorker(settings.model, settings.worker_device, settings.worker_args)
        try:
            address = embedded.start(settings.worker_ready_timeout_s)
        except EmbeddedWorkerError as exc:
            _fail(str(exc))
        settings = settings.model_copy(update={"workers": [address]})
    exit_code = 0
    try:
        if settings.processes > 1:
            # The embedded worker, if any, is shared: every process connects to it.
            from render_server.processes import serve_processes

            exit_code = serve_processes(settings)
        else:
            _serve(settings)
    finally:
        if embedded is not None:
            embedded.stop()
    if exit_code:
        sys.exit(exit_code)


def build_app(settings: RenderSettings) -> FastAPI:
    """The app; a bad model, tokenizer or template exits 2 with the reason."""
    from render_server.http.app import create_app
    from render_server.templating.tokenizer import TokenizerLoadError

    try:
        return create_app(settings)
    except ModelNotFoundError as exc:
        _fail(str(exc))
    except TokenizerLoadError as exc:
        _fail(f"cannot load the tokenizer of {settings.model!r}: {exc}")
    except OSError as exc:
        _fail(f"cannot read {exc.filename or 'a file'}: {exc.strerror or exc}")


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


def _serve(settings: RenderSettings) -> None:
    app = build_app(settings)
    announce(settings, settings.port)
    serve_app(settings, app)


def serve_app(
    settings: RenderSettings, app: FastAPI, sockets: list[socket.socket] | None = None
) -> bool:
    """Run `app` under a DrainingServer until it exits; on `sockets` already bound (by the
    --processes supervisor) or else on settings.host/port. Returns whether it started."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        root_path=settings.root_path,
        # "auto" picks uvloop and httptools (both in the `render` extra) when importable.
        loop="auto",
        http="auto",
        lifespan="on",
        log_config=None,  # logging.basicConfig above already routes uvicorn's loggers
        log_level=LOG_LEVELS[settings.log_level],
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.timeout_graceful_shutdown_s,
        timeout_keep_alive=settings.timeout_keep_alive_s,
        server_header=False,
    )
    state = app.state.render
    server = DrainingServer(config, state.admission, settings.drain_timeout_s)
    server.run(sockets=sockets)
    return server.started


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM: /ready turns 503 and new generation
    requests are refused (so a load balancer moves on), in-flight streams get up to
    `drain_timeout_s` to finish, then the server exits 0. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, admission: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._admission = admission
        self._drain_timeout_s = drain_timeout_s
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
                "drain timeout: %d requests still in flight", self._admission.in_flight
            )
        self.should_exit = True


if __name__ == "__main__":
    main()
