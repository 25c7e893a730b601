"""Builds one step's flattened batch and runs the model on it.

Every scheduled sequence contributes `num_new_tokens` tokens starting at its
`num_computed_tokens`; prefill chunks and decodes sit side by side in one batch. Only
the last token of a sequence that will sample needs logits, so the LM head runs on
those rows alone. A sequence that asked for prompt logprobs also needs its prompt rows:
their hidden states come back as they are, for the sampler's side to score them in
slices (a whole chunk's logits at once could take gigabytes). The batch's layout and
its upload are `gpu_worker.attention.metadata`'s (the same builder the tests use); the
runner adds the token ids and the rows to sample.

Block tables are not rebuilt each step: `gpu_worker.runner.block_table` keeps a row per
running sequence and writes only the blocks each gained, and the step's tables are a
gather of its rows on the device. Rows are freed through `release` with the scheduler's
`finished_request_ids`.

Speculative decoding: a sequence with drafts computes its last known token and its k
drafts and samples at all 1 + k rows, for verification. Attention sees those 1 + k tokens
as 1 + k one-token decodes of the same block-table row, the j-th over the context plus
drafts 0..j-1 (all written to the cache before any layer reads it): a verify step is a
decode step to every backend, so it takes the CPU decode kernel, the Triton decode kernel
and the decode CUDA graphs, and each row's attention is computed exactly as a plain decode
of that token would compute it.

Async scheduling: a decoding sequence may be scheduled while the token it computes is
still unresolved (sampled by the previous step, not yet read by the host). Its input id
is a placeholder in the host batch (`HostBatch.unresolved_rows`), overwritten on the
device from the previous step's sampled ids before the forward (`execute_host`'s
`previous`), for an eager step as for a replayed graph.

LoRA (`use_lora`, before the graphs are captured): before a step's forward its adapters
are made resident (the registry copies missing ones into slots) and every token row gets
its sequence's slot, -1 for the base model: set on the model's `LoRAState` for an eager
step, staged as one more graph input for a replayed decode step. A tensor-parallel
follower has no registry: its steps arrive with rank 0's slots (`execute_host`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import (
    AttentionMetadata,
    BatchLayout,
    layout_batch,
    to_device,
    upload_batch,
)
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.models.base import CausalLM
from gpu_worker.runner.block_table import BlockTable, BlockTableStep
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner

InputFill = Callable[[torch.Tensor], None]
"""Writes a step's unresolved input ids into its input-id tensor on the device."""


class PreviousTokens(Protocol):
    """The last step's sampled ids on the device and their rows by request
    (`gpu_worker.sampling.sampled_tokens.SampledTokens`)."""

    @property
    def device_ids(self) -> torch.Tensor: ...

    @property
    def row_of(self) -> Mapping[str, int]: ...


class AdapterSlots(Protocol):
    """Where a step's adapters become resident (`gpu_worker.lora.manager.LoRARegistry`)."""

    def acquire(self, names: Iterable[str]) -> Mapping[str, int]: ...


class AdapterRows(Protocol):
    """The per-row slots the wrapped model reads (`gpu_worker.lora.layers.LoRAState`)."""

    def set_rows(self, row_slots: torch.Tensor | None) -> None: ...


@dataclass
class RunnerOutput:
    """One step's model output."""

    logits: torch.Tensor
    """[sampling rows, >= vocab] fp32 logits of each sampling sequence's last token, or of
    its last 1 + k tokens when it has k drafts, in batch order."""
    prompt_hidden: torch.Tensor | None = None
    """[rows, hidden] final hidden states at every scheduled `prompt_logprob_positions`
    position, sequence by sequence in batch order; None when no sequence asked."""


@dataclass(frozen=True)
class HostBatch:
    """One step's inputs on the host, before they cross to the device."""

    input_ids: np.ndarray
    """[num_tokens] int64."""
    layout: BatchLayout
    table: BlockTableStep
    sample_rows: np.ndarray | None
    """Rows whose logits are sampled; None when every row samples (a pure decode step)."""
    prompt_rows: np.ndarray | None
    """Rows whose hidden states score prompt logprobs; None when no sequence asked."""
    table_shape: tuple[int, int]
    """[rows, cols] of the persistent block table once `table`'s writes are in: their flat
    indices count in its columns. A rank that runs a batch prepared elsewhere (a TP
    follower) grows its own table to this shape first, so the writes land alike."""
    unresolved_rows: np.ndarray | None = None
    """Token rows whose input is the previous step's sampled id, not yet on the host; None
    when every input is known."""
    unresolved_sources: np.ndarray | None = None
    """For each of `unresolved_rows`, its row in the previous step's sampled ids."""


class ModelRunner:
    """Owns the model, its attention backend and its KV caches; turns scheduled sequences
    into logits."""

    def __init__(
        self,
        model: CausalLM,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.block_table = BlockTable(device)
        self.decode_graphs: DecodeGraphRunner | None = None
        """Set by `capture_decode_graphs` on CUDA: pure-decode steps then replay graphs."""
        self.num_graph_steps = 0
        self._lora_registry: AdapterSlots | None = None
        self._lora_rows: AdapterRows | None = None

    def use_lora(self, registry: AdapterSlots | None, state: AdapterRows) -> None:
        """Serve adapters through `state` (`attach_lora` wrapped the model over the slots),
        made resident by `registry` (None on a TP follower, whose slots rank 0's steps
        fill); before `capture_decode_graphs`, whose graphs then stage each row's slot."""
        if self.decode_graphs is not None:
            raise RuntimeError("use_lora comes before the decode graphs are captured")
        self._lora_registry, self._lora_rows = registry, state

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture the decode graphs for batches up to `max_batch_size` sequences of up to
        `max_model_len` tokens (CUDA only)."""
        graphs = DecodeGraphRunner(
            self.model,
            self.attn_backend,
            self.kv_caches,
            self.block_table,
            max_batch_size=max_batch_size,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
            capture=True,
            set_lora_rows=None if self._lora_rows is None else self._lora_rows.set_rows,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the block-table rows of requests that left the running set."""
        self.block_table.release(request_ids)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledSequence], previous: PreviousTokens | None = None
    ) -> RunnerOutput:
        """Run one step: fp32 logits for each sampling sequence, in batch order, and the
        hidden states of the prompt rows whose logprobs were asked for. `previous`: the
        last step's sampled ids on the device, for inputs the host does not have yet."""
        row_of = None if previous is None else previous.row_of
        batch = self.prepare(scheduled, row_of)
        ids = None if previous is None else previous.device_ids
        return self.execute_host(batch, self.adapter_slots(scheduled), ids)

    def adapter_slots(self, scheduled: list[ScheduledSequence]) -> np.ndarray | None:
        """Each attention sequence's adapter slot (-1: the base model), its adapters made
        resident first (a drafted sequence's slot repeated over its 1 + k verify rows);
        None when LoRA is off or no sequence of the step has an adapter. What
        `execute_host` takes (and a TP rank 0 sends its followers with the step)."""
        names = {item.seq.lora_name for item in scheduled}
        names.discard(None)
        if not names:
            return None
        if self._lora_registry is None:
            raise RuntimeError("the step names adapters but this runner has no LoRA registry")
        slot_of = self._lora_registry.acquire(name for name in names if name is not None)
        slots = np.array(
            [
                -1 if item.seq.lora_name is None else slot_of[item.seq.lora_name]
                for item in scheduled
            ],
            dtype=np.int32,
        )
        repeats = _attention_rows(scheduled)
        return slots if repeats is None else np.repeat(slots, repeats)

    def _set_lora_rows(self, layout: BatchLayout, seq_slots: np.ndarray | None) -> None:
        """An eager step's slot per token row, each sequence's repeated over its tokens."""
        if self._lora_rows is None:
            return
        if seq_slots is None:
            self._lora_rows.set_rows(None)
            return
        rows = np.repeat(seq_slots, np.diff(layout.query_start_loc))
        self._lora_rows.set_rows(torch.from_numpy(rows).to(self.device))

    @torch.inference_mode()
    def execute_host(
        self,
        batch: HostBatch,
        adapter_slots: np.ndarray | None = None,
        previous_ids: torch.Tensor | None = None,
    ) -> RunnerOutput:
        """Run a prepared step: this runner's own `prepare`, or, on a TP follower, the
        leader's, received over the wire. Either way the batch's block-table writes go into
        this runner's table, so every rank's table stays the leader's. `adapter_slots`:
        each sequence's LoRA slot (`adapter_slots`), None for a base-only step."""
        self._fit_table(batch.table_shape)
        graphs = self.decode_graphs
        fill = self._unresolved_fill(batch, previous_ids)
        if graphs is not None and graphs.can_run(batch.layout, batch.table):
            hidden = graphs.run(batch.input_ids, batch.layout, batch.table, adapter_slots, fill)
            self.num_graph_steps += 1
            # Rare in a decode step (a one-token prefill chunk), so their own small copy.
            rows = [r for r in (batch.sample_rows, batch.prompt_rows) if r is not None]
            uploaded = to_device(rows, torch.int64, self.device) if rows else []
            sample_rows = None if batch.sample_rows is None else uploaded.pop(0)
            prompt_rows = None if batch.prompt_rows is None else uploaded.pop(0)
        else:
            input_ids, positions, meta, sample_rows, prompt_rows = self.upload(batch)
            if fill is not None:
                fill(input_ids)
            self._set_lora_rows(batch.layout, adapter_slots)
            self.attn_backend.plan(meta, self.kv_caches[0])
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        prompt_hidden = None if prompt_rows is None else hidden.index_select(0, prompt_rows)
        if sample_rows is None:
            logits = self.model.compute_logits(hidden)
        elif sample_rows.numel() == 0:
            logits = hidden.new_empty((0, 0), dtype=torch.float32)
        else:
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        return RunnerOutput(logits, prompt_hidden)

    def _unresolved_fill(
        self, batch: HostBatch, previous_ids: torch.Tensor | None
    ) -> InputFill | None:
        """What writes the unresolved inputs into a step's input ids on the device; None
        when the batch has none."""
        rows, sources = batch.unresolved_rows, batch.unresolved_sources
        if rows is None or sources is None:
            return None
        if previous_ids is None:
            raise ValueError("the batch has unresolved inputs but no previous step's ids")
        rows_t, sources_t = to_device([rows, sources], torch.int64, self.device)
        values = previous_ids.index_select(0, sources_t)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, rows_t, values)

        return fill

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] -> fp32 logits [n, >= vocab] (prompt logprobs)."""
        return self.model.compute_logits(hidden)

    def prepare(
        self, scheduled: list[ScheduledSequence], unresolved: Mapping[str, int] | None = None
    ) -> HostBatch:
        """The step's host arrays: token ids, the layout (slots from the persistent block
        table, which takes each sequence's new blocks here), the rows to sample and the
        prompt-logprob rows. `unresolved`: the rows of the previous step's sampled ids by
        request, when that step's tokens are not on the host yet (async scheduling)."""
        # List comprehensions, not one loop storing into numpy: this runs per sequence
        # every step, and numpy scalar stores cost more than the work they record.
        seqs = [item.seq for item in scheduled]
        starts = [item.num_computed_tokens for item in scheduled]
        num_new = [item.num_new_tokens for item in scheduled]
        fills: tuple[np.ndarray, np.ndarray] | None = None
        if unresolved is not None:
            input_ids, fills = _inputs_with_unresolved(scheduled, unresolved)
        elif max(num_new, default=0) == 1:  # every sequence decodes one token
            input_ids = [seq.all_token_ids[start] for seq, start in zip(seqs, starts, strict=True)]
        else:
            input_ids = []
            for item, seq, start, n in zip(scheduled, seqs, starts, num_new, strict=True):
                drafts = item.draft_token_ids
                input_ids += seq.all_token_ids[start : start + n - len(drafts)] + drafts
        query_lens = np.array(num_new, dtype=np.int64)
        context_lens = np.array(starts, dtype=np.int64)
        # The rows each sequence samples, ending its chunk: its last, or 1 + k with drafts.
        num_sample_rows = np.array(
            [1 + len(item.draft_token_ids) if item.will_sample else 0 for item in scheduled],
            dtype=np.int64,
        )
        num_prompt_rows = np.array(
            [
                len(item.prompt_logprob_positions)
                if seq.sampling.prompt_logprobs is not None
                else 0
                for item, seq in zip(scheduled, seqs, strict=True)
            ],
            dtype=np.int64,
        )

        table = self.block_table.update(seqs)
        repeats = _attention_rows(scheduled)
        if repeats is not None:
            # Each drafted sequence's 1 + k tokens become 1 + k one-token decodes, the
            # j-th after its context and drafts 0..j-1; every one of them samples.
            offsets = np.arange(int(repeats.sum())) - np.repeat(
                np.cumsum(repeats) - repeats, repeats
            )
            context_lens = np.repeat(context_lens, repeats) + offsets
            drafted = np.repeat(repeats > 1, repeats)
            query_lens = np.where(drafted, 1, np.repeat(query_lens, repeats))
            num_sample_rows = np.where(drafted, 1, np.repeat(num_sample_rows, repeats))
            num_prompt_rows = np.where(drafted, 0, np.repeat(num_prompt_rows, repeats))
            table = replace(table, rows=np.repeat(table.rows, repeats))
        layout = layout_batch(
            query_lens, context_lens, self.block_table.host, self.block_size, table.rows
        )
        ends = layout.query_start_loc[1:]
        if num_sample_rows.max(initial=0) > 1:
            sample_rows = _first_rows(ends - num_sample_rows, num_sample_rows)
        else:
            sample_rows = ends[num_sample_rows > 0] - 1
        every_row_samples = len(sample_rows) == layout.num_tokens
        prompt_rows = None
        if num_prompt_rows.any():
            prompt_rows = _first_rows(layout.query_start_loc[:-1], num_prompt_rows)
        ids = np.asarray(input_ids, dtype=np.int64)
        return HostBatch(
            ids,
            layout,
            table,
            None if every_row_samples else sample_rows,
            prompt_rows,
            (int(self.block_table.host.shape[0]), self.block_table.num_cols),
            None if fills is None else fills[0],
            None if fills is None else fills[1],
        )

    def upload(
        self, batch: HostBatch
    ) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None, torch.Tensor | None
    ]:
        """Host batch -> device tensors for an eager step: input ids, positions, attention
        metadata, the rows to sample and the prompt-logprob rows (None as in the batch)."""
        table = batch.table
        extra = [batch.input_ids, batch.layout.positions, table.rows, table.index]
        extra += [r for r in (batch.sample_rows, batch.prompt_rows) if r is not None]
        uploaded = upload_batch(batch.layout, self.device, extra, [table.values])
        input_ids, positions, rows, index, *row_sets = uploaded.extra
        self.block_table.apply(index, uploaded.extra_i32[0])
        meta = uploaded.metadata(self.block_table.gather(rows, table.width))
        sample_rows = None if batch.sample_rows is None else row_sets.pop(0)
        prompt_rows = None if batch.prompt_rows is None else row_sets.pop(0)
        return input_ids, positions, meta, sample_rows, prompt_rows

    def _fit_table(self, shape: tuple[int, int]) -> None:
        """Grow the block table to the preparing rank's `shape` (a no-op on that rank): a
        follower never hands out rows itself, and the leader's flat write indices assume
        its shape."""
        num_rows, num_cols = shape
        self.block_table.reserve(num_cols, num_rows)


def _inputs_with_unresolved(
    scheduled: list[ScheduledSequence], row_of: Mapping[str, int]
) -> tuple[list[int], tuple[np.ndarray, np.ndarray] | None]:
    """The step's input ids with a placeholder (0) for each token the host has not read
    yet, and those tokens' rows with their rows in the previous step's ids (None: none)."""
    input_ids: list[int] = []
    rows: list[int] = []
    sources: list[int] = []
    for item in scheduled:
        tokens = item.seq.all_token_ids
        start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
        if end <= len(tokens):
            input_ids += tokens[start:end]
            continue
        # Only a decode computes an unresolved token: its one input is the last sample.
        assert item.num_new_tokens == 1 and not item.draft_token_ids, "one unresolved input"
        rows.append(len(input_ids))
        sources.append(row_of[item.seq.request_id])
        input_ids.append(0)
    if not rows:
        return input_ids, None
    return input_ids, (np.array(rows, dtype=np.int64), np.array(sources, dtype=np.int64))


def _attention_rows(scheduled: list[ScheduledSequence]) -> np.ndarray | None:
    """How many attention sequences each scheduled one becomes: 1 + k for one with k
    drafts (its verify rows), 1 otherwise; None when no sequence drafted."""
    if not any(item.draft_token_ids for item in scheduled):
        return None
    return np.array([1 + len(item.draft_token_ids) for item in scheduled], dtype=np.int64)


def _first_rows(chunk_starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The first `counts[i]` rows of each sequence's chunk, in order: a sequence's
    prompt-logprob positions start its chunk."""
    starts = np.repeat(chunk_starts, counts)
    return starts + np.arange(len(starts)) - np.repeat(np.cumsum(counts) - counts, counts)
