"""Dependencies of the routers, as `Annotated` aliases.

The app holds one RenderState, built once by `app.build_state` from the settings; routes
reach it through `StateDep` rather than through globals.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from render_server.http.metrics import RenderMetrics
from render_server.parsing.tool_choice import ToolSetup, tool_setup
from render_server.schemas.errors import SERVER_ERROR, ApiError, model_not_found
from render_server.settings import RenderSettings

if TYPE_CHECKING:
    from render_server.generation.lifecycle import Generation
    from render_server.generation.metrics import GenerationMetrics
    from render_server.http.admission import Admission
    from render_server.store import ResponseStore
    from render_server.templating.chat_template import ChatRenderer
    from render_server.templating.token_text import TokenText
    from render_server.templating.tokenizer import Tokenizer
    from render_server.worker_client.discovery import WorkerDiscovery
    from render_server.worker_client.lora import LoRAModule
    from render_server.worker_client.pool import WorkerPool


@dataclass(frozen=True)
class RenderState:
    """Everything the routes share, built once per app."""

    settings: RenderSettings
    model_id: str
    """The served name: what clients pass as `model`."""
    root_model: str
    """The model's own name (before --served-model-name)."""
    created: int
    """Unix time the app was built; reported by /v1/models."""
    version: str
    """The duet package version."""
    tokenizer: Tokenizer
    renderer: ChatRenderer
    metrics: RenderMetrics
    token_text: TokenText
    """Cached per-token text and bytes for logprobs."""
    generation_metrics: GenerationMetrics
    admission: Admission | None = None
    """In-flight generation requests and the draining flag (set by create_app)."""
    workers: WorkerPool | None = None
    """The connections to the gpu-workers; None on a --render-only server."""
    discovery: WorkerDiscovery | None = None
    """Keeps `workers` in step with --worker-dns; None without it."""
    live_generations: set[Generation] = field(default_factory=set)
    """Generations started and not yet closed (a drain that runs out of time stops them)."""
    response_store: ResponseStore | None = None
    """Stored Responses API responses (set by build_state; shared across processes when
    --response-store is redis://)."""
    generate_requests: dict[str, set[Generation]] = field(default_factory=dict)
    """Open /inference/v1/generate requests by the client's request_id (ids may repeat),
    for /inference/v1/abort_requests."""
    family_tool_parser: str | None = None
    """The model family's tool-call parser (`family_defaults`), for when neither
    --tool-call-parser nor the chat template names one."""
    lora_modules: tuple[LoRAModule, ...] = ()
    """The adapters of --lora-modules (parsed once)."""

    @cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes when the model, its tokenizer, the chat
        template or duet's build change, and only then (a client can tell whether two
        answers came from the same configuration)."""
        parts = [self.root_model, self.tokenizer.digest, self.renderer.chat_template or ""]
        digest = hashlib.sha256("\0".join([*parts, self.version]).encode()).hexdigest()
        return f"fp_{digest[:10]}"

    @property
    def max_model_len(self) -> int:
        """The context length: the tokenizer's, capped by what the workers accept."""
        card = self.workers.model_card if self.workers is not None else None
        if card is None:
            return self.tokenizer.max_model_len
        return min(card.max_model_len, self.tokenizer.max_model_len)

    def require_workers(self) -> WorkerPool:
        """The pool, or the 503 a client gets when nothing can generate."""
        if self.workers is None:
            raise ApiError(
                503,
                "This render server runs with --render-only: it cannot generate.",
                type=SERVER_ERROR,
                code="render_only",
            )
        if not self.workers.is_ready():
            raise ApiError(
                503,
                "No gpu-worker is connected and alive; retry shortly.",
                type=SERVER_ERROR,
                code="no_workers",
                headers={"Retry-After": "1"},
            )
        return self.workers

    def tool_setup(self) -> ToolSetup:
        """What the flags and the templates mean for tools (the same for every request)."""
        settings = self.settings
        return tool_setup(
            tool_call_parser=settings.tool_call_parser,
            enable_auto_tool_choice=settings.enable_auto_tool_choice,
            chat_template=self.renderer.chat_template,
            builtin_template=self.renderer.tools_template,
            family_tool_parser=self.family_tool_parser,
        )

    def lora_adapters(self) -> dict[str, str | None]:
        """Every LoRA adapter a request may name, with its path where known: --lora-modules,
        runtime loads, and whatever a connected worker registers."""
        if self.workers is not None:  # it started from --lora-modules and keeps them current
            return self.workers.lora_adapters()
        return {module.name: module.path for module in self.lora_modules}

    def lora_name_of(self, requested: str | None) -> str | None:
        """The adapter a request's `model` selects: None for the served model (or no
        `model`), the adapter's name for an adapter; else the OpenAI 404 ("" is a name,
        of no model)."""
        if requested is None or requested == self.model_id:
            return None
        if requested in self.lora_adapters():
            return requested
        raise model_not_found(requested)

    def check_model(self, requested: str | None) -> None:
        """Raise the OpenAI 404 unless `requested` is absent or names the served model or
        one of its adapters."""
        self.lora_name_of(requested)

    def served_name(self, requested: str | None) -> str:
        """The `model` an answer reports: the adapter's name for a request that selected
        one (as vLLM does), else the served model's."""
        return self.lora_name_of(requested) or self.model_id


# Dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency on the
# thread pool, which costs far more than these one-line lookups.
async def get_state(request: Request) -> RenderState:
    """The app's RenderState (set by create_app)."""
    return request.app.state.render


async def get_request_id(request: Request) -> str:
    """The id RequestContextMiddleware gave this request (also in X-Request-Id)."""
    return request.scope.get("state", {}).get("request_id", "")


StateDep = Annotated[RenderState, Depends(get_state)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
