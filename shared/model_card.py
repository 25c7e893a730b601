"""ModelCard: what a worker serves, as the render tier needs to know it."""

from __future__ import annotations

from typing import Literal

import msgspec

SchedulingPolicy = Literal["fcfs", "priority"]


# omit_defaults: a card with default values for its newer fields still decodes on a render
# server that predates them (the decoder refuses unknown fields).
class ModelCard(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Identity and limits of the model a worker serves.

    The render server refuses a worker whose `tokenizer_digest` differs from the
    digest of its own tokenizer: token ids only mean something under one vocabulary.
    """

    model_id: str
    """The id clients pass as `model`."""
    tokenizer_digest: str
    """Hex SHA-256 of the canonical tokenizer JSON (computed by
    render_server.templating.tokenizer)."""
    vocab_size: int
    """Rows of the embedding / logits; every token id is below this."""
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    max_model_len: int
    """Longest prompt + output the worker accepts."""
    block_size: int = 16
    """KV cache block size; also the unit of the prefix hashes."""
    architecture: str = "llama"
    dtype: str = "float32"
    scheduling_policy: SchedulingPolicy = "fcfs"
    """The worker's `--scheduling-policy`. Under "fcfs" it refuses a request whose
    `priority` is not 0 (invalid_request), so the render answers 400 naming `priority`
    before sending; under "priority" lower values run first and are preempted last."""
    max_loras: int = 0
    """LoRA adapters the worker holds in slots at once (`--max-loras`); 0 = LoRA off."""
    max_lora_rank: int = 0
    """Largest adapter rank the worker accepts (`--max-lora-rank`); 0 when LoRA is off."""
