"""The FastAPI app factory: state built once from RenderSettings, routers, middleware,
exception handlers."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI

from render_server.generation.metrics import GenerationMetrics
from render_server.http.admission import Admission, AdmissionMiddleware
from render_server.http.api import ROUTERS, lora
from render_server.http.api.deps import RenderState
from render_server.http.api.tokenize import TokenizeFastPath
from render_server.http.errors import install_exception_handlers
from render_server.http.memory import MemoryReleaseMiddleware, MemoryReleaser
from render_server.http.metrics import RenderMetrics
from render_server.http.middleware import (
    ApiKeyMiddleware,
    CorsMiddleware,
    LimitsMiddleware,
    RequestContextMiddleware,
)
from render_server.parsing.family_defaults import family_defaults
from render_server.settings import RenderSettings
from render_server.store import open_store
from render_server.templating.chat_template import ChatRenderer
from render_server.templating.templates import read_chat_template
from render_server.templating.token_text import TokenText
from render_server.templating.tokenizer import Tokenizer
from render_server.worker_client.discovery import WorkerDiscovery, load_resolver
from render_server.worker_client.pool import WorkerError, WorkerPool
from shared.curve import render_keys
from shared.model_source import resolve_model

logger = logging.getLogger(__name__)

# How long startup waits for a first worker before serving anyway (then /ready is 503).
_WORKER_CONNECT_WAIT_S = 10.0

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def _duet_version() -> str:
    try:
        return importlib.metadata.version("duet")
    except importlib.metadata.PackageNotFoundError:  # running from a bare checkout
        return "0+unknown"


def build_state(settings: RenderSettings) -> RenderState:
    """Load the tokenizer and chat template once.

    Raises ModelNotFoundError for a `--model` that names nothing, TokenizerLoadError for
    files that hold no usable tokenizer, OSError for an unreadable `--chat-template`.
    """
    source = resolve_model(settings.model)
    root_model = source.name
    if settings.served_model_name:
        source = replace(source, name=settings.served_model_name)
    started = time.perf_counter()
    tokenizer = Tokenizer.from_source(source, piece_cache_bytes=settings.tokenizer_cache_mb << 20)
    template = read_chat_template(settings.chat_template) if settings.chat_template else None
    renderer = ChatRenderer(
        tokenizer,
        template,
        render_deadline_s=settings.render_deadline_s,
        max_output_chars=settings.render_max_output_chars,
        trust_request_chat_template=settings.trust_request_chat_template,
        tokenize_special_text_in_content=settings.tokenize_special_text_in_content,
    )
    logger.info(
        "loaded tokenizer of %s (%s) in %.2fs: vocab %d, max_model_len %d",
        source.name,
        source.path,
        time.perf_counter() - started,
        tokenizer.vocab_size,
        tokenizer.max_model_len,
    )
    # The model's own template, not --chat-template's: it tells Llama 3 from Llama 2.
    defaults = family_defaults(source, tokenizer.chat_template)
    if settings.reasoning_parser is None and defaults.reasoning_parser is not None:
        settings = settings.model_copy(update={"reasoning_parser": defaults.reasoning_parser})
    if defaults.family is not None:
        logger.info(
            "model family %s: default tool-call parser %s, reasoning parser %s",
            defaults.family,
            defaults.tool_call_parser,
            settings.reasoning_parser,
        )
    lora_modules = tuple(settings.lora_module_paths())
    if any(module.name == source.name for module in lora_modules):
        logger.warning(
            "the LoRA adapter named %r is unreachable: `model` names the served model", source.name
        )
    metrics = RenderMetrics(settings.metrics_multiprocess_dir)
    workers = discovery = None
    if not settings.render_only and (settings.workers or settings.worker_dns):
        workers = WorkerPool(
            settings.workers,
            tokenizer_digest=tokenizer.digest,
            client_id=f"render-{os.getpid()}",
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            curve=render_keys(settings.zmq_curve_dir) if settings.zmq_curve_dir else None,
            routing=settings.routing,
            lora_modules=lora_modules,
        )
        if settings.worker_dns:
            discovery = WorkerDiscovery(
                workers,
                settings.worker_dns,
                static=settings.workers,
                interval_s=settings.worker_dns_interval_s,
                resolver=load_resolver(settings.worker_dns_resolver),
            )
    return RenderState(
        settings=settings,
        model_id=source.name,
        root_model=root_model,
        created=int(time.time()),
        version=_duet_version(),
        tokenizer=tokenizer,
        renderer=renderer,
        metrics=metrics,
        token_text=TokenText(tokenizer),
        family_tool_parser=defaults.tool_call_parser,
        lora_modules=lora_modules,
        generation_metrics=GenerationMetrics(
            metrics, workers.statuses if workers is not None else None, model_name=source.name
        ),
        workers=workers,
        discovery=discovery,
        admission=Admission(settings.max_pending, settings.stream_write_timeout_s),
        response_store=open_store(
            settings.response_store,
            ttl_s=settings.response_store_ttl_s,
            max_bytes=settings.response_store_max_bytes,
            max_record_bytes=settings.response_store_max_record_bytes,
        ),
    )


def _lifespan(state: RenderState, owns_state: bool) -> Lifespan:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The worker connections start here, on uvicorn's loop; the tokenizer is loaded
        # before the app exists, so a bad model fails before binding.
        if state.discovery is not None:
            await state.discovery.refresh()  # the first addresses, before connecting
        if state.workers is not None:
            try:
                await state.workers.start(_WORKER_CONNECT_WAIT_S)
            except WorkerError as exc:
                # Serve anyway: /ready says 503 and the pool keeps trying in the background.
                logger.warning("no gpu-worker yet: %s", exc.message)
        if state.discovery is not None:
            state.discovery.start()
        try:
            yield
        finally:
            if state.discovery is not None:
                await state.discovery.close()
            if state.workers is not None:
                await state.workers.close()
            if state.response_store is not None:
                await state.response_store.close()
            if owns_state:  # a state passed in belongs to the caller, who closes it
                state.renderer.close()

    return lifespan


def create_app(settings: RenderSettings, state: RenderState | None = None) -> FastAPI:
    """Build the render server app. `state` may be passed in to share a loaded tokenizer
    between apps (tests, benchmarks); by default it is built from `settings`."""
    owns_state = state is None
    state = state if state is not None else build_state(settings)
    app = FastAPI(
        title="duet render server",
        version=state.version,
        lifespan=_lifespan(state, owns_state),
        # A trailing-slash redirect would build an absolute URL from the Host header;
        # `/v1/models/` is simply a 404 instead.
        redirect_slashes=False,
    )
    app.state.render = state
    for router in ROUTERS:
        app.include_router(router)
    if settings.allow_runtime_lora_updating:
        logger.warning(
            "runtime LoRA loading and unloading is on: any client may load adapters from "
            "the workers' --lora-root"
        )
        app.include_router(lora.router)
    install_exception_handlers(app)

    # add_middleware puts each new layer outside the previous ones, so this reads innermost
    # first: Admission -> TokenizeFastPath -> ApiKey -> MemoryRelease -> Limits -> CORS ->
    # RequestContext (outermost). /tokenize is no generation route, so admission never
    # sees it anyway.
    if state.admission is not None:
        # Inside auth and limits: only requests that passed them count as pending.
        app.add_middleware(AdmissionMiddleware, admission=state.admission)
    app.add_middleware(TokenizeFastPath, state=state)
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=settings.api_keys)
    app.add_middleware(MemoryReleaseMiddleware, releaser=MemoryReleaser())
    app.add_middleware(
        LimitsMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
        max_header_count=settings.max_header_count,
    )
    if settings.cors_allow_origins:
        app.add_middleware(
            CorsMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=settings.cors_allow_methods,
            allow_headers=settings.cors_allow_headers,
            allow_credentials=settings.cors_allow_credentials,
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics)
    return app
