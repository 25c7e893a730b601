"""The step's third call, sample / verify: the rows without drafts sampled on the device
(their ids start for the host at once, `SampledTokenCopy`), the drafted rows verified by
the speculator, and what the step's update will need, as a `LaunchedStep`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.core.scheduler import ScheduledSequence, SchedulerOutput
from gpu_worker.core.sequence import Sequence
from gpu_worker.engine.speculation import Speculator
from gpu_worker.runner.model_runner import RunnerOutput
from gpu_worker.sampling.penalties import has_penalty
from gpu_worker.sampling.sampled_tokens import SampledTokenCopy, SampledTokens
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.sampling.upload import upload


@dataclass
class LaunchedStep:
    """A step whose model work is launched and whose tokens are not applied yet."""

    output: SchedulerOutput
    started: float
    """When the step began (`time.perf_counter`), for the draft-length controller."""
    plain_items: list[ScheduledSequence]
    """The items sampled with one row each, in the order of `tokens`' rows."""
    tokens: SampledTokens | None
    """Their sampled ids, on the device and on their way to the host; None without any."""
    verified: dict[str, list[int]]
    """The tokens each item with drafts keeps (verification's result, on the host)."""

    @property
    def needs_host_tokens(self) -> bool:
        """A sequence of it samples its next token from its tokens on the host (a grammar,
        penalties, bad_words): the next step cannot be scheduled before this one's update.
        Asked only under async scheduling, so in-order steps never pay for it."""
        return any(_samples_from_host_tokens(item.seq) for item in self.plain_items)


def launch_sampling(
    output: SchedulerOutput,
    run: RunnerOutput,
    started: float,
    sampler: Sampler,
    token_copy: SampledTokenCopy,
    speculator: Speculator | None,
) -> LaunchedStep:
    """Launch the sampling of the items without drafts (one logits row each) and verify
    the ones with (k + 1 rows each, in batch order)."""
    logits = run.logits
    plain_items: list[ScheduledSequence] = []
    plain_rows: list[int] = []
    drafted_items: list[ScheduledSequence] = []
    drafted_rows: list[int] = []
    row = 0
    for item in output.scheduled:
        if not item.will_sample:
            continue
        width = 1 + len(item.draft_token_ids)
        if width > 1:
            drafted_items.append(item)
            drafted_rows.extend(range(row, row + width))
        else:
            plain_items.append(item)
            plain_rows.append(row)
        row += width
    tokens = None
    if plain_items:
        plain_logits = logits
        if drafted_items:
            plain_logits = logits.index_select(0, upload(plain_rows, torch.long, logits.device))
        result = sampler.sample(plain_logits, [item.seq for item in plain_items])
        row_of = {item.seq.request_id: i for i, item in enumerate(plain_items)}
        tokens = token_copy.start(result, row_of)
    verified: dict[str, list[int]] = {}
    if drafted_items:
        assert speculator is not None, "only a speculator drafts"
        verified = speculator.verify(logits, drafted_rows, drafted_items)
    return LaunchedStep(output, started, plain_items, tokens, verified)


def _samples_from_host_tokens(seq: Sequence) -> bool:
    """The sampler reads `seq`'s output tokens on the host for its next token: its grammar
    matcher, its penalty rows and its bad_words advance with each one."""
    state = seq.sampler_state
    return state.matcher is not None or state.token_filter is not None or has_penalty(seq.sampling)
