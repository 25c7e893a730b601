"""Per-request state on the worker: tokens, progress, blocks and how it ended.

Token accounting is unified, as in vLLM v1: a sequence has `num_tokens` known tokens of
which the first `num_computed_tokens` have KV in the cache. Prefill, chunked prefill,
decode and recompute after preemption are all "compute the next few uncomputed tokens".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpu_worker.sampling.state import SamplerState
from shared.hashing import BlockHash, hash_block, prefix_block_hashes, root_hash
from shared.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; the FINISHED_* ones are final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    """Back in the waiting queue with its blocks freed; it recomputes when readmitted."""
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()


class FinishReason(enum.StrEnum):
    """Why a sequence ended, spelled as the OpenAI API's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISHED_STATUS = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
}


@dataclass(eq=False)  # identity semantics: sequences live in queues and are removed by identity
class Sequence:
    """One request being generated: its tokens, its KV blocks and its progress."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    """Per-tenant salt mixed into the block hashes, so tenants never share cached blocks."""
    lora_name: str | None = None
    """The LoRA adapter it runs under (None: the base model). Its block hashes root in the
    adapter's own tree: KV computed under one adapter is wrong under any other."""
    priority: int = 0
    """Lower runs first under the scheduler's "priority" policy; 0 under "fcfs"."""
    arrival_order: int = 0
    """Set by the scheduler when it takes the sequence: equal priorities run in this order."""
    arrival_time: float = field(default_factory=time.monotonic)
    """When the worker took the request (`time.monotonic`, the worker's own clock)."""
    block_size: int = 16
    """Must equal the KV cache's block size: it decides which blocks get hashed."""
    sampler_state: SamplerState = field(default_factory=SamplerState, repr=False)
    """The sampler's own state for this request (grammar matcher, token filters, prompt
    logprobs); the sampler reads the params and tokens from the sequence itself."""

    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache; the next step computes from here."""
    num_unresolved: int = 0
    """Tokens sampled by scheduled steps that the host has not received yet: 1 from
    scheduling to `update`, 2 while async scheduling runs a step ahead."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Drafts proposed for the next step (speculative decoding, before `schedule`), which
    the scheduler trims to what its budget and the KV cache allow."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when first scheduled (reported to clients)."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """When the scheduler first gave it a step (`time.monotonic`); None while it waits."""
    block_table: list[int] = field(default_factory=list)
    """Block ids holding this sequence's KV, in token order."""
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    """The `stop_token_ids` entry that ended it (the API's `stop_reason`); None for EOS."""

    output_token_ids: list[int] = field(init=False, default_factory=list)
    all_token_ids: list[int] = field(init=False)
    """Prompt then output in one list, appended in place so the hot path never concatenates."""
    block_hashes: list[BlockHash] = field(init=False)
    """Chained hashes of every full block of `all_token_ids`, extended as blocks fill."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = prefix_block_hashes(
            self.all_token_ids, self.block_size, self.cache_salt, lora_name=self.lora_name
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_position(self) -> int:
        """The output index of the token a scheduled step samples: the tokens sampled
        before it count whether or not the host has them (seeded draws and min_tokens
        read it). Outside a step, the next token's index."""
        return len(self.output_token_ids) + max(self.num_unresolved - 1, 0)

    @property
    def last_token_id(self) -> int:
        return self.all_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has no output yet (they come with the first
        token), so every prompt position must be computed: none read from the cache."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def queue_time(self) -> float | None:
        """Seconds between arrival and the first step; None until it is scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def append_token(self, token_id: int) -> None:
        """Add one generated token; hash the last block if this token filled it."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_tokens = len(self.all_token_ids)
        if num_tokens % self.block_size == 0:
            # Only the block just filled is hashed: its parent's hash is already known.
            parent = (
                self.block_hashes[-1]
                if self.block_hashes
                else root_hash(self.cache_salt, self.lora_name)
            )
            self.block_hashes.append(
                hash_block(parent, self.all_token_ids[num_tokens - self.block_size :])
            )

    def finish(self, reason: FinishReason, stop_token_id: int | None = None) -> None:
        """Mark the sequence done; the scheduler frees its blocks."""
        self.finish_reason = reason
        self.stop_token_id = stop_token_id
        self.status = _FINISHED_STATUS[reason]
