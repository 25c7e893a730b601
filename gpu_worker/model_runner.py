"""Builds one step's flattened batch and runs the model on it.

Every scheduled sequence contributes `num_new_tokens` tokens starting at its
`num_computed_tokens`; prefill chunks and decodes sit side by side in one batch. Only
the last token of a sequence that will sample needs logits, so the LM head runs on
those rows alone.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attention import AttentionMetadata
from gpu_worker.scheduler import ScheduledSequence


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

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run one step; return fp32 logits for each sampling sequence, in batch order."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts = [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        block_size = self.block_size
        for item in scheduled:
            seq = item.seq
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(
                table[pos // block_size] * block_size + pos % block_size
                for pos in range(start, end)
            )
            query_starts.append(query_starts[-1] + item.num_new_tokens)
            context_lens.append(start)
            block_tables.append(table)
            if item.will_sample:
                sample_rows.append(query_starts[-1] - 1)

        seq_lens = [c + (query_starts[i + 1] - query_starts[i]) for i, c in enumerate(context_lens)]
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(q - p for p, q in zip(query_starts, query_starts[1:], strict=False)),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            self.kv_caches,
        )
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
        return self.model.compute_logits(hidden.index_select(0, rows))
