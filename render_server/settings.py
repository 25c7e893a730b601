"""RenderSettings: every knob of the render server, built once at the entry point.

The CLI turns its flags into a RenderSettings and passes it down to `create_app`; nothing
below the entry point reads environment variables. Each field can also come from a
`DUET_<FIELD>` environment variable (flags win). List fields accept a comma-separated
string or a JSON list in the environment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from render_server.worker_client.discovery import parse_host_port
from render_server.worker_client.routing import RoutingMode
from shared.model_source import DEFAULT_MODEL

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]

# NoDecode: pydantic-settings would otherwise insist on JSON for list-typed env vars,
# and `DUET_API_KEY=k1,k2` is what operators write.
StrList = Annotated[list[str], NoDecode]


def _split_list(value: object) -> object:
    """Accept "a,b", '["a","b"]' or a list; drop blanks so a trailing comma is harmless."""
    if isinstance(value, str):
        text = value.strip()
        items = json.loads(text) if text.startswith("[") else text.split(",")
        return [str(item).strip() for item in items if str(item).strip()]
    return value


class RenderSettings(BaseSettings):
    """Configuration of one render-serve process (HTTP front, tokenizer, chat template)."""

    model_config = SettingsConfigDict(
        env_prefix="DUET_",
        # Field names still work as constructor keywords when an env alias is set.
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    # -- model ---------------------------------------------------------------------------
    model: str = DEFAULT_MODEL
    """Built-in model name, a `.gguf` file or an HF model directory (see shared.model_source)."""
    served_model_name: str | None = None
    """The id clients pass as `model` and /v1/models reports; defaults to the model's name."""
    chat_template: Path | None = None
    """A jinja file that replaces the model's own chat template."""
    trust_request_chat_template: bool = False
    """Let requests carry their own `chat_template` (still sandboxed and time-limited)."""
    tokenize_special_text_in_content: bool = False
    """Treat special-token text inside message content as special tokens (unsafe)."""
    render_deadline_s: float = Field(default=2.0, gt=0)
    """Wall-clock budget for one chat-template render; past it the request gets a 400."""
    render_max_output_chars: int = Field(default=4_000_000, gt=0)
    """Longest text one chat-template render may produce."""
    tokenizer_cache_mb: int = Field(default=32, ge=0)
    """Cache of the token ids of text pieces seen before (system prompts, earlier turns);
    0 turns it off, for deployments where a client timing its requests must not learn
    whether another client sent the same text."""

    # -- HTTP ----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address to bind; loopback unless the operator opens it up."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port to bind (0 lets the OS pick one)."""
    root_path: str = ""
    """ASGI root_path when served behind a proxy under a path prefix (e.g. `/api`)."""
    api_keys: StrList = Field(
        default_factory=list,
        validation_alias=AliasChoices("DUET_API_KEY", "DUET_API_KEYS"),
        repr=False,  # secrets stay out of logs and tracebacks
    )
    """Accepted Bearer tokens; empty means no authentication. Env: DUET_API_KEY=k1,k2."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    """Largest request body accepted; larger ones get 413."""
    max_header_bytes: int = Field(default=64 * 1024, gt=0)
    """Largest total size of the request headers (names + values); larger gets 431."""
    max_header_count: int = Field(default=100, gt=0)
    """Most request headers accepted; more gets 431."""
    cors_allow_origins: StrList = Field(default_factory=list)
    """Origins allowed by CORS; empty disables CORS entirely (no CORS headers are sent)."""
    cors_allow_methods: StrList = Field(default_factory=lambda: ["GET", "POST", "OPTIONS"])
    """Methods allowed by CORS preflight."""
    cors_allow_headers: StrList = Field(
        default_factory=lambda: ["Authorization", "Content-Type", "X-Request-Id"]
    )
    """Request headers allowed by CORS preflight."""
    cors_allow_credentials: bool = False
    """Whether CORS responses allow credentials (cookies); never with a `*` origin."""
    timeout_graceful_shutdown_s: int = Field(default=10, ge=0)
    """Seconds in-flight requests get to finish on SIGTERM before the server stops."""
    timeout_keep_alive_s: int = Field(default=5, ge=1)
    """Seconds an idle keep-alive connection stays open."""
    processes: int = Field(default=1, ge=1, le=256)
    """Render processes sharing the port, each a full server with its own connections to
    every worker; /metrics in any of them sums all their counters."""
    metrics_multiprocess_dir: Path | None = None
    """Set by `--processes` for its children (no flag): the directory where every render
    process of the server keeps its metric values, for /metrics to sum."""
    # -- workers and generation ----------------------------------------------------------
    workers: StrList = Field(default_factory=list)
    """ZMQ addresses of running gpu-workers. Empty, with no worker_dns (and not render_only):
    spawn a local one."""
    worker_dns: StrList = Field(default_factory=list)
    """HOST:PORT names whose every A/AAAA record is a gpu-worker (a Kubernetes headless
    Service), re-resolved every worker_dns_interval_s: new workers join, vanished ones drain."""
    worker_dns_interval_s: float = Field(default=10.0, gt=0)
    """Seconds between two resolutions of worker_dns."""
    worker_dns_resolver: str | None = None
    """Testing hook (hidden flag): `module:function` mapping (host, port) to worker
    addresses in place of DNS."""
    routing: RoutingMode = "prefix"
    """`prefix`: least load with prefix-cache affinity; `round_robin`: each worker in turn
    (a baseline for benchmarks)."""
    render_only: bool = False
    """Serve only what needs no worker (tokenize, detokenize, models); generation is a 503."""
    worker_device: str = "auto"
    """Device of the embedded worker (auto, cuda, cpu)."""
    worker_args: StrList = Field(default_factory=list)
    """Extra gpu-worker flags for the embedded worker, e.g. `--max-num-seqs=64`."""
    worker_ready_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the embedded worker to load its model."""
    heartbeat_timeout_s: float = Field(default=3.0, gt=0)
    """A worker silent this long is dead; its requests fail or move."""
    zmq_curve_dir: Path | None = None
    """CURVE keys to reach workers on untrusted networks (render.key_secret, worker.key)."""
    max_pending: int = Field(default=1024, ge=1)
    """Generation requests in flight per render process; beyond it, 429 with Retry-After."""
    write_timeout_s: float = Field(default=30.0, gt=0)
    """A client that does not take a response chunk for this long is cut off."""
    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: how long in-flight streams may run to completion before exit."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice "auto"); needs tool_call_parser."""
    tool_call_parser: str | None = None
    """How to read tool calls in the model's text: hermes, llama3_json, mistral, pythonic."""
    reasoning_parser: str | None = None
    """Split reasoning from the answer: deepseek_r1 or qwen3."""
    structured_outputs_in_reasoning: bool = False
    """Apply structured-output constraints to the reasoning too (vLLM's enable_in_reasoning);
    by default, with a reasoning parser, they hold only for the answer after it."""
    max_n: int = Field(default=16, ge=1, le=128)
    """Largest `n` a request may ask for."""
    access_log: bool = False
    """Log one line per request (off by default: it costs throughput)."""
    log_level: LogLevel = "info"
    """Log level of the server and of uvicorn."""

    @field_validator(
        "api_keys",
        "workers",
        "worker_dns",
        "worker_args",
        "cors_allow_origins",
        "cors_allow_methods",
        "cors_allow_headers",
        mode="before",
    )
    @classmethod
    def _split(cls, value: object) -> object:
        return _split_list(value)

    @field_validator("api_keys")
    @classmethod
    def _printable_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            # A key with whitespace or control characters can never match a header value.
            if any(ch.isspace() or not ch.isprintable() for ch in key):
                raise ValueError("an API key must not contain whitespace or control characters")
        return keys

    @field_validator("worker_dns")
    @classmethod
    def _host_ports(cls, names: list[str]) -> list[str]:
        for name in names:
            parse_host_port(name)  # a ValueError names the bad entry
        return names

    @field_validator("root_path")
    @classmethod
    def _root_path_shape(cls, value: str) -> str:
        value = value.rstrip("/")
        if value and not value.startswith("/"):
            raise ValueError("root_path must start with '/'")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, value: str | None) -> str | None:
        from render_server.parsing.tool_parsers import TOOL_PARSERS

        if value is not None and value not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {value!r}; known: {sorted(TOOL_PARSERS)}")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        from render_server.parsing.reasoning import REASONING_PARSERS

        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {value!r}; known: {sorted(REASONING_PARSERS)}"
            )
        return value

    @model_validator(mode="after")
    def _no_credentials_for_any_origin(self) -> RenderSettings:
        # With credentials Starlette mirrors the caller's origin instead of sending `*`,
        # which would hand any web page the user's cookies for this server.
        if self.cors_allow_credentials and "*" in self.cors_allow_origins:
            raise ValueError("cors_allow_credentials cannot be combined with a `*` origin")
        return self
