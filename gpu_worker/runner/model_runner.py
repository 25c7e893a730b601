"""Builds one step's flattened batch and runs the model on it.

Every scheduled sequence contributes `num_new_tokens` tokens starting at its
`num_computed_tokens`; prefill chunks and decodes sit side by side in one batch. Only
the last token of a sequence that will sample needs logits, so the LM head runs on
those rows alone.

The batch is built on the host with numpy (one vectorized pass, however many prefill
tokens) and crosses to the device as two packed buffers, one per dtype, from pinned
memory on CUDA, instead of one small copy per metadata tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gpu_worker.attention.torch_backend import AttentionMetadata
from gpu_worker.engine.scheduler import ScheduledSequence
from gpu_worker.runner.cuda_graphs import DecodeGraphRunner


class ModelRunner:
    """Owns the model and its KV caches; turns scheduled sequences into logits."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.decode_graphs: DecodeGraphRunner | None = None
        """Set by the engine on CUDA: pure-decode steps then replay captured graphs."""
        self.num_graph_steps = 0

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; return fp32 logits for each sampling sequence, in batch order."""
        input_ids, positions, meta, sample_rows = self._prepare(scheduled)
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(meta):
            hidden = graphs.run(input_ids, positions, meta)
            self.num_graph_steps += 1
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if sample_rows is None:
            return self.model.compute_logits(hidden)
        if sample_rows.numel() == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, sample_rows))

    def _prepare(
        self, scheduled: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """Host lists -> device tensors: input ids, positions, attention metadata and the
        rows to sample (None when every token samples, as in a pure decode step)."""
        block_size = self.block_size
        num_seqs = len(scheduled)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        context_lens = np.empty(num_seqs, dtype=np.int64)
        input_ids: list[int] = []
        tables: list[list[int]] = []
        will_sample = np.empty(num_seqs, dtype=bool)
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

        num_tokens = len(input_ids)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = context_lens + query_lens
        # Token t of sequence i sits at position context_lens[i] + (t - query_start_loc[i]).
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) + np.repeat(
            context_lens - query_start_loc[:-1], query_lens
        )
        width = max(len(t) for t in tables)
        block_tables = np.zeros((num_seqs, width), dtype=np.int64)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
        slots = block_tables[seq_of_token, positions // block_size] * block_size
        slots += positions % block_size
        sample_rows = query_start_loc[1:][will_sample] - 1
        every_row_samples = len(sample_rows) == num_tokens

        i64 = [np.asarray(input_ids, dtype=np.int64), positions, slots]
        if not every_row_samples:
            i64.append(sample_rows)
        i32 = [query_start_loc, seq_lens, context_lens, block_tables.ravel()]
        ids, pos, slot_mapping, *rows = self._upload(i64, torch.int64)
        starts, seq_lens_t, context_lens_t, tables_t = self._upload(i32, torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=starts,
            seq_lens=seq_lens_t,
            context_lens=context_lens_t,
            block_tables=tables_t.view(num_seqs, width),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=query_start_loc.tolist(),
            context_lens_host=context_lens.tolist(),
        )
        return ids, pos, meta, (rows[0] if rows else None)

    def _upload(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """Concatenate host arrays into one buffer, move it to the device in one copy
        (pinned and non-blocking on CUDA) and return views of the parts."""
        sizes = [a.size for a in arrays]
        host = torch.from_numpy(np.concatenate(arrays).astype(_NUMPY[dtype], copy=False))
        if self.device.type == "cuda":
            packed = host.pin_memory().to(self.device, non_blocking=True)
        else:
            packed = host.to(self.device)
        return list(packed.split(sizes))


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}
