"""Every message on the wire between render servers and gpu-workers.

A frame is `MAGIC + version byte + msgpack body`. The body is one member of a tagged
union per direction, decoded with a typed msgspec decoder: untrusted bytes never become
arbitrary objects, unknown fields are refused, and every list and string is bounded.
Anything that does not decode raises a `ProtocolError` subclass; the decoder object
stays usable for the next frame.

New fields are appended with defaults; a change that old peers cannot read bumps
PROTOCOL_VERSION.
"""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

import msgspec

from shared.model_card import ModelCard
from shared.sampling import INT64_MAX, INT64_MIN, SamplingParams, TokenId

PROTOCOL_VERSION = 3
MAGIC = b"DU"
HEADER_BYTES = len(MAGIC) + 1

MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_PROMPT_TOKENS = 1 << 20
MAX_BATCH = 65536
MAX_TOP_LOGPROBS = 20
MAX_CONSTRAINT_CHARS = 256 * 1024

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ShortText = Annotated[str, msgspec.Meta(max_length=4096)]
LoRAName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
"""The name a LoRA adapter is served under (a request's `model`)."""
FinishReason = Literal["stop", "length", "abort", "error"]


class ProtocolError(ValueError):
    """A frame could not be decoded."""


class FrameTooLarge(ProtocolError):
    """The frame exceeds MAX_FRAME_BYTES."""


class BadFrame(ProtocolError):
    """Garbage, truncated, or a body that is not a valid message."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    def __init__(self, version: int) -> None:
        super().__init__(f"peer speaks protocol v{version}, this build speaks v{PROTOCOL_VERSION}")
        self.version = version


class _Message(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    """Base of every wire message; the class's tag names it on the wire."""


# ---- render -> worker ---------------------------------------------------------------


ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class Constraint(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A structured-output constraint on a request's output (see shared.constraints)."""

    kind: ConstraintKind
    spec: Annotated[str, msgspec.Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    """JSON schema text, a regex, a Lark/GBNF grammar, or a JSON list of choices;
    empty for json_object."""
    num_resumed_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)] = 0
    """The last this-many prompt tokens were generated under this constraint already (a
    failover resume): the worker's matcher consumes them before the first new token."""
    start_after: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    """Apply the constraint only after this text appears in the output (the end tag of
    the model's reasoning, e.g. `</think>`); before it the output is free."""


class Hello(_Message, tag="hello", kw_only=True):
    """First message of a render client; the worker answers Welcome."""

    protocol_version: int = PROTOCOL_VERSION
    client_id: ShortText = ""
    """Human-readable name of the render process, for logs."""


class Generate(_Message, tag="generate", kw_only=True):
    """Start generating for one sequence."""

    request_id: RequestId
    prompt_token_ids: Annotated[
        list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)
    ]
    sampling: SamplingParams
    priority: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] = 0
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    """Per-tenant salt mixed into the prefix hashes so tenants never share cached blocks."""
    arrival_time: float = 0.0
    """Wall-clock time the render server received the HTTP request."""
    constraint: Constraint | None = None
    """Structured output: every generated token must keep the output inside it."""
    lora_name: LoRAName | None = None
    """Run under this registered LoRA adapter; None is the base model."""


class Abort(_Message, tag="abort", kw_only=True):
    """Stop these requests and free their KV blocks now."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=MAX_BATCH)]


class ClientHeartbeat(_Message, tag="client_heartbeat", kw_only=True):
    """Render process liveness, so a worker can free the requests of one that vanished."""

    sent_at: float


class LoadLoRA(_Message, tag="load_lora", kw_only=True):
    """Register a LoRA adapter from the worker's disk (inside its --lora-root); the worker
    answers LoRAResult with the same op_id."""

    op_id: RequestId
    lora_name: LoRAName
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)]


class UnloadLoRA(_Message, tag="unload_lora", kw_only=True):
    """Forget a registered LoRA adapter; answered by LoRAResult with the same op_id."""

    op_id: RequestId
    lora_name: LoRAName


RenderToWorker = Hello | Generate | Abort | ClientHeartbeat | LoadLoRA | UnloadLoRA


# ---- worker -> render ---------------------------------------------------------------


class Welcome(_Message, tag="welcome", kw_only=True):
    """The worker's answer to Hello."""

    protocol_version: int = PROTOCOL_VERSION
    worker_id: ShortText
    model_card: ModelCard


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Logprob of one sampled token, its rank, and the top alternatives."""

    logprob: float
    rank: int
    top_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = []
    top_logprobs: Annotated[list[float], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] = []


class RequestDelta(msgspec.Struct, array_like=True, forbid_unknown_fields=True, omit_defaults=True):
    """What one request produced in one engine step."""

    request_id: RequestId
    new_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The stop/eos token that ended the sequence (OpenAI's stop_reason)."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    logprobs: list[TokenLogprobs] | None = None
    """One entry per new token when the request asked for logprobs."""
    error: ShortText | None = None
    queue_time: float | None = None
    """Seconds between the worker receiving the request and its first step (first delta)."""
    prompt_logprobs: (
        Annotated[list[TokenLogprobs | None], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] | None
    ) = None
    """On the first delta of a request that asked for `prompt_logprobs`: one entry per
    prompt token, in order; the first is None (nothing precedes it). Each entry is the
    token's raw logprob, its rank and the top-k at its position."""


def merge_delta(into: RequestDelta, new: RequestDelta) -> None:
    """Fold a later delta of the same request into one not yet delivered.

    The one rule for coalescing, used by the worker (a client's full pipe) and the render
    tier (a busy consumer): tokens and logprobs append; a finish (with its stop token), a
    prompt or cache count and an error take the later value; `queue_time` and
    `prompt_logprobs` keep the first value set, as only a request's first delta carries them.
    """
    into.new_token_ids.extend(new.new_token_ids)
    if new.logprobs is not None:
        if into.logprobs is None:
            into.logprobs = new.logprobs
        else:
            into.logprobs.extend(new.logprobs)
    if new.finish_reason is not None:
        into.finish_reason = new.finish_reason
        into.stop_token_id = new.stop_token_id
    if new.num_prompt_tokens:
        into.num_prompt_tokens = new.num_prompt_tokens
    if new.num_cached_tokens:
        into.num_cached_tokens = new.num_cached_tokens
    if new.error is not None:
        into.error = new.error
    if into.queue_time is None:
        into.queue_time = new.queue_time
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


class Deltas(_Message, tag="deltas", kw_only=True):
    """Every new token of one engine step for one render client."""

    deltas: Annotated[list[RequestDelta], msgspec.Meta(max_length=MAX_BATCH)]
    step: int = 0


class WorkerStats(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Load and health of a worker, sent every second."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    gpu_memory_used_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_utilization: float | None = None
    steps: int = 0
    bad_frames: int = 0
    """Frames the worker could not decode since it started."""
    lora_registered: Annotated[list[LoRAName], msgspec.Meta(max_length=MAX_BATCH)] = []
    """LoRA adapters the worker can serve: its --lora-modules and runtime loads."""
    lora_resident: Annotated[list[LoRAName], msgspec.Meta(max_length=MAX_BATCH)] = []
    """The registered adapters in the worker's --max-loras slots now (no load before use)."""
    lora_loads: int = 0
    """Adapter copies into a slot since the worker started."""
    lora_evictions: int = 0
    """Resident adapters displaced (least recently used) to make room for another."""
    spec_num_draft_tokens: int = 0
    """Tokens drafted for speculative decoding since the worker started (0 when off)."""
    spec_num_accepted_tokens: int = 0
    """Of those, the ones verification accepted."""
    spec_method: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    """The --speculative-config method ("ngram", "suffix", "draft_model"); None when off."""
    spec_num_drafts: int = 0
    """Verify events since the worker started: a request with at least one draft in a step."""
    spec_accepted_per_position: Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH)] = []
    """Index j: drafts accepted at draft position j (the acceptance length distribution: a
    draft at j is accepted only after those before it, so the counts never grow with j and
    sum to `spec_num_accepted_tokens`); one entry per position up to K."""


class Heartbeat(_Message, tag="heartbeat", kw_only=True):
    """Worker liveness and load."""

    sent_at: float
    stats: WorkerStats


RejectCode = Literal[
    "invalid_request",
    "too_long",
    "queue_full",
    "duplicate",
    "protocol",
    "lora_not_found",
    "lora_disabled",
]
"""`lora_not_found`: the request names an adapter the worker has not registered (render
answers 404); `lora_disabled`: it names one and the worker runs without --enable-lora (400)."""


class Rejected(_Message, tag="rejected", kw_only=True):
    """The worker will not run this request."""

    request_id: RequestId
    code: RejectCode
    message: ShortText


class LoRAResult(_Message, tag="lora_result", kw_only=True):
    """The answer to LoadLoRA or UnloadLoRA."""

    op_id: RequestId
    ok: bool
    status: int
    """HTTP-style: 200 done, 400 invalid or refused, 404 not found, 409 already loaded or in use."""
    message: ShortText


WorkerToRender = Welcome | Deltas | Heartbeat | Rejected | LoRAResult


# ---- framing ------------------------------------------------------------------------

_HEADER = MAGIC + bytes([PROTOCOL_VERSION])


class Encoder:
    """Encodes any wire message into one frame. Reuse one per thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: _Message) -> bytes:
        return _HEADER + self._encoder.encode(message)


T = TypeVar("T")


class _Decoder(Generic[T]):
    def __init__(self, message_type: object, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._max_frame_bytes = max_frame_bytes

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self._max_frame_bytes:
            raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds {self._max_frame_bytes}")
        if len(frame) < HEADER_BYTES or bytes(frame[:2]) != MAGIC:
            raise BadFrame("not a duet frame (bad magic)")
        if frame[2] != PROTOCOL_VERSION:
            raise VersionMismatch(frame[2])
        try:
            return self._decoder.decode(memoryview(frame)[HEADER_BYTES:])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadFrame(str(exc)) from exc


class RenderMessageDecoder(_Decoder[RenderToWorker]):
    """The worker's decoder for what render servers send."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        super().__init__(RenderToWorker, max_frame_bytes)


class WorkerMessageDecoder(_Decoder[WorkerToRender]):
    """The render server's decoder for what workers send."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        super().__init__(WorkerToRender, max_frame_bytes)
