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
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import uvicorn
from pydantic import ValidationError
from uvicorn.config import LOG_LEVELS

from render_server.settings import LogLevel, RenderSettings
from shared.model_source import ModelNotFoundError

if TYPE_CHECKING:
    from fastapi import FastAPI

PROG = "render-serve"


def _default(field: str) -> Any:
    info = RenderSettings.model_fields[field]
    return info.get_default(call_default_factory=True)


def build_parser() -> argparse.ArgumentParser:
    """The flags of render-serve; each one is also a DUET_* environment variable."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="duet's CPU render server: OpenAI-style HTTP front, chat templates and "
        "tokenization. Every flag can also be set as DUET_<NAME> in the environment.",
        # Unset flags must stay unset so the environment and the defaults can fill them.
        argument_default=argparse.SUPPRESS,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        help=f"built-in model name, .gguf file or HF model directory "
        f"(default: {_default('model')})",
    )
    model.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the id clients pass as `model` (default: the model's own name)",
    )
    model.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="jinja file replacing the model's chat template, or the name of a built-in "
        "one: chatml_tools (hermes-style tool calling)",
    )
    model.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="honour a `chat_template` sent in a request (still sandboxed and time-limited)",
    )
    model.add_argument(
        "--tokenize-special-text-in-content",
        action="store_true",
        help="read special-token text inside message content as special tokens (unsafe)",
    )
    model.add_argument(
        "--render-deadline",
        dest="render_deadline_s",
        type=float,
        metavar="SECONDS",
        help=f"time budget of one chat-template render (default: {_default('render_deadline_s')})",
    )
    model.add_argument(
        "--tokenizer-cache-mb",
        type=int,
        metavar="MB",
        help="cache of token ids of text seen before, e.g. system prompts; 0 turns it off, "
        "so that request timing cannot tell whether another client sent the same text "
        f"(default: {_default('tokenizer_cache_mb')})",
    )

    workers = parser.add_argument_group(
        "workers (default: start a local gpu-worker and serve through it)"
    )
    workers.add_argument(
        "--worker",
        dest="workers",
        action="append",
        metavar="ADDR",
        help="ZMQ address of a running gpu-worker (tcp://HOST:PORT or ipc://PATH); repeat "
        "for several. Without any, render-serve starts a local worker itself",
    )
    workers.add_argument(
        "--worker-dns",
        dest="worker_dns",
        action="append",
        metavar="HOST:PORT",
        help="find workers in DNS: every A/AAAA record of HOST (e.g. a Kubernetes headless "
        "Service) is a worker on PORT; re-resolved every --worker-dns-interval, so workers "
        "join and leave without a restart. Repeatable; combines with --worker",
    )
    workers.add_argument(
        "--worker-dns-interval",
        dest="worker_dns_interval_s",
        type=float,
        metavar="SECONDS",
        help=f"how often --worker-dns is resolved again "
        f"(default: {_default('worker_dns_interval_s')})",
    )
    # Testing hook: answers --worker-dns from a `module:function` instead of DNS.
    workers.add_argument("--worker-dns-resolver", help=argparse.SUPPRESS)
    workers.add_argument(
        "--routing",
        choices=["prefix", "round_robin"],
        help="how requests pick a worker: prefix (least load, preferring the worker that "
        "likely caches the prompt's prefix) or round_robin (each in turn, for comparison) "
        f"(default: {_default('routing')})",
    )
    workers.add_argument(
        "--render-only",
        action="store_true",
        help="no workers: serve tokenize, detokenize and models only (generation is a 503)",
    )
    workers.add_argument(
        "--worker-device",
        metavar="DEVICE",
        help="device of the local worker: auto, cuda or cpu "
        f"(default: {_default('worker_device')})",
    )
    workers.add_argument(
        "--worker-arg",
        dest="worker_args",
        action="append",
        metavar="FLAG",
        help="extra flag for the local worker, e.g. --worker-arg=--max-num-seqs=64; repeatable",
    )
    workers.add_argument(
        "--worker-ready-timeout",
        dest="worker_ready_timeout_s",
        type=float,
        metavar="SECONDS",
        help="how long to wait for the local worker to load "
        f"(default: {_default('worker_ready_timeout_s')})",
    )
    workers.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=float,
        metavar="SECONDS",
        help=f"a worker silent this long is dead (default: {_default('heartbeat_timeout_s')})",
    )
    workers.add_argument(
        "--zmq-curve-dir",
        type=Path,
        metavar="DIR",
        help="encrypt worker traffic with CURVE: DIR holds render.key_secret and the "
        "worker's public worker.key (see shared/curve.py)",
    )
    workers.add_argument(
        "--max-pending",
        type=int,
        metavar="N",
        help="generation requests in flight per process before 429 "
        f"(default: {_default('max_pending')})",
    )
    workers.add_argument(
        "--write-timeout",
        dest="write_timeout_s",
        type=float,
        metavar="SECONDS",
        help="cut off a client that stops reading its stream for this long "
        f"(default: {_default('write_timeout_s')})",
    )
    workers.add_argument(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, /ready turns 503 and in-flight streams get this long to finish "
        f"(default: {_default('drain_timeout_s')})",
    )
    tools = parser.add_argument_group("tool calling and reasoning")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto")',
    )
    tools.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="how to read tool calls in the model's text: hermes, llama3_json, mistral, pythonic",
    )
    tools.add_argument(
        "--reasoning-parser",
        metavar="NAME",
        help="split the model's reasoning from its answer: deepseek_r1 or qwen3",
    )
    tools.add_argument(
        "--structured-outputs-in-reasoning",
        action="store_true",
        help="apply structured-output constraints to the reasoning too (by default they "
        "hold only for the answer after it)",
    )
    workers.add_argument(
        "--max-n",
        type=int,
        metavar="N",
        help=f"largest `n` a request may ask for (default: {_default('max_n')})",
    )

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", help=f"address to bind (default: {_default('host')})")
    http.add_argument("--port", type=int, help=f"port to bind (default: {_default('port')})")
    http.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="render processes sharing the port, each connected to every worker; /metrics "
        f"sums them all (default: {_default('processes')})",
    )
    http.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accepted Bearer token; repeat for several. Every route but /health and "
        "/version then needs one (env: DUET_API_KEY=k1,k2)",
    )
    http.add_argument(
        "--root-path",
        metavar="PREFIX",
        help="path prefix when served behind a proxy that strips it (e.g. /api)",
    )
    http.add_argument(
        "--max-body-bytes",
        type=int,
        metavar="BYTES",
        help=f"largest request body, else 413 (default: {_default('max_body_bytes')})",
    )
    http.add_argument(
        "--max-header-bytes",
        type=int,
        metavar="BYTES",
        help=f"largest total header size, else 431 (default: {_default('max_header_bytes')})",
    )
    http.add_argument(
        "--max-header-count",
        type=int,
        metavar="COUNT",
        help=f"most request headers, else 431 (default: {_default('max_header_count')})",
    )
    http.add_argument(
        "--timeout-graceful-shutdown",
        dest="timeout_graceful_shutdown_s",
        type=int,
        metavar="SECONDS",
        help="time in-flight requests get on shutdown "
        f"(default: {_default('timeout_graceful_shutdown_s')})",
    )
    http.add_argument(
        "--access-log", action="store_true", help="log one line per request (default: off)"
    )
    http.add_argument(
        "--log-level",
        choices=list(LogLevel.__args__),
        help=f"log level (default: {_default('log_level')})",
    )

    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins",
        dest="cors_allow_origins",
        action="append",
        metavar="ORIGIN",
        help="origin allowed by CORS; repeat or comma-separate; `*` for any",
    )
    cors.add_argument(
        "--allowed-methods",
        dest="cors_allow_methods",
        action="append",
        metavar="METHOD",
        help=f"CORS methods (default: {','.join(_default('cors_allow_methods'))})",
    )
    cors.add_argument(
        "--allowed-headers",
        dest="cors_allow_headers",
        action="append",
        metavar="HEADER",
        help=f"CORS request headers (default: {','.join(_default('cors_allow_headers'))})",
    )
    cors.add_argument(
        "--allow-credentials",
        dest="cors_allow_credentials",
        action="store_true",
        help="let CORS responses allow credentials",
    )
    return parser


def _comma_split(values: list[str]) -> list[str]:
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def parse_settings(argv: Sequence[str] | None = None) -> RenderSettings:
    """Parse flags into RenderSettings; a bad value exits 2 with argparse's message."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    for key in (
        "cors_allow_origins",
        "cors_allow_methods",
        "cors_allow_headers",
        "workers",
        "worker_dns",
    ):
        if key in given:
            given[key] = _comma_split(given[key])
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
