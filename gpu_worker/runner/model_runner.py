"""Builds one step's flattened batch and runs the model on it.

Every scheduled sequence contributes `num_new_tokens` tokens starting at its
`num_computed_tokens`; prefill chunks and decodes sit side by side in one batch. Only
the last token of a sequence that will sample needs logits, so the LM head runs on
those rows alone. A sequence that asked for prompt logprobs also needs its prompt rows:
their hidden states come back as they are, for the sampler's side to score them in
slices (a whole chunk's logits at once could take gigabytes). The batch's layout and
its upload are `gpu_worker.attention.metadata`'s (the same builder the tests use); the
runner adds the token ids and the rows to sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.metadata import AttentionMetadata, layout_batch, upload_batch
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.models.base import CausalLM
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner


@dataclass
class RunnerOutput:
    """One step's model output."""

    logits: torch.Tensor
    """[sampling sequences, >= vocab] fp32 logits of each sampling sequence's last token."""
    prompt_hidden: torch.Tensor | None = None
    """[rows, hidden] final hidden states at every scheduled `prompt_logprob_positions`
    position, sequence by sequence in batch order; None when no sequence asked."""


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
        self.decode_graphs: DecodeGraphRunner | None = None
        """Set by `capture_decode_graphs` on CUDA: pure-decode steps then replay graphs."""
        self.num_graph_steps = 0

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture the decode graphs for batches up to `max_batch_size` sequences of up to
        `max_model_len` tokens (CUDA only)."""
        graphs = DecodeGraphRunner(
            self.model,
            self.attn_backend,
            self.kv_caches,
            max_batch_size=max_batch_size,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
            capture=True,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> RunnerOutput:
        """Run one step: fp32 logits for each sampling sequence, in batch order, and the
        hidden states of the prompt rows whose logprobs were asked for."""
        input_ids, positions, meta, sample_rows, prompt_rows = self._prepare(scheduled)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(meta):
            hidden = graphs.run(input_ids, positions, meta)
            self.num_graph_steps += 1
        else:
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

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] -> fp32 logits [n, >= vocab] (prompt logprobs)."""
        return self.model.compute_logits(hidden)

    def _prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[
        torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None, torch.Tensor | None
    ]:
        """Host lists -> device tensors: input ids, positions, attention metadata, the
        rows to sample (None when every token samples, as in a pure decode step) and the
        prompt-logprob rows (None when no sequence asked)."""
        num_seqs = len(scheduled)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        context_lens = np.empty(num_seqs, dtype=np.int64)
        input_ids: list[int] = []
        tables: list[list[int]] = []
        will_sample = np.empty(num_seqs, dtype=bool)
        num_prompt_rows = np.zeros(num_seqs, dtype=np.int64)
        for i, item in enumerate(scheduled):
            start, num_new = item.num_computed_tokens, item.num_new_tokens
            query_lens[i] = num_new
            context_lens[i] = start
            if num_new == 1:
                input_ids.append(item.seq.all_token_ids[start])
            else:
                input_ids.extend(item.seq.all_token_ids[start : start + num_new])
            tables.append(item.seq.block_table)
            will_sample[i] = item.will_sample
            num_prompt_rows[i] = len(item.prompt_logprob_positions)

        layout = layout_batch(query_lens, context_lens, tables, self.block_size)
        sample_rows = layout.query_start_loc[1:][will_sample] - 1
        extra = [np.asarray(input_ids, dtype=np.int64), layout.positions]
        every_row_samples = len(sample_rows) == layout.num_tokens
        if not every_row_samples:
            extra.append(sample_rows)
        has_prompt_rows = bool(num_prompt_rows.any())
        if has_prompt_rows:
            # A sequence's prompt-logprob positions start its chunk: its first rows.
            starts = np.repeat(layout.query_start_loc[:-1], num_prompt_rows)
            offsets = np.arange(len(starts)) - np.repeat(
                np.cumsum(num_prompt_rows) - num_prompt_rows, num_prompt_rows
            )
            extra.append(starts + offsets)
        meta, (ids, positions, *rows) = upload_batch(layout, self.device, extra)
        sample_t = None if every_row_samples else rows.pop(0)
        prompt_t = rows.pop(0) if has_prompt_rows else None
        return ids, positions, meta, sample_t, prompt_t
