"""`render-serve`: flags -> RenderSettings -> app -> uvicorn.

Flags override `DUET_*` environment variables, which override the defaults: only flags
actually given are passed to RenderSettings, the rest it reads from the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

from render_server.serve import PROG, configure_logging, fail, serve
from render_server.settings import RenderSettings
from shared.cli_fields import add_fields, given_fields
from shared.model_source import ModelNotFoundError

if TYPE_CHECKING:
    pass


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
            fail(str(exc))
        except OSError as exc:
            fail(f"cannot read {exc.filename or 'a file'}: {exc.strerror or exc}")
    if wants_embedded:
        embedded = EmbeddedWorker(settings.model, settings.worker_device, settings.worker_args)
        try:
            address = embedded.start(settings.worker_ready_timeout_s)
        except EmbeddedWorkerError as exc:
            fail(str(exc))
        settings = settings.model_copy(update={"workers": [address]})
    exit_code = 0
    try:
        if settings.processes > 1:
            # The embedded worker, if any, is shared: every process connects to it.
            from render_server.processes import serve_processes

            exit_code = serve_processes(settings)
        else:
            serve(settings)
    finally:
        if embedded is not None:
            embedded.stop()
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
