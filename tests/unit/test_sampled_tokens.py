"""A step's sampled ids on their way to the host (gpu_worker.sampling.sampled_tokens): the
ids in row order, the device tensor kept for the next step's inputs, logprobs alongside;
on CUDA through two pinned buffers in turn, each read waiting for its own copy only."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling.sampled_tokens import SampledTokenCopy
from gpu_worker.sampling.sampler import SamplerOutput


def _output(ids: list[int], device: torch.device) -> SamplerOutput:
    sampled = torch.tensor(ids, dtype=torch.int64, device=device)
    logprobs = -torch.arange(len(ids), dtype=torch.float32, device=device)
    return SamplerOutput(sampled=sampled, logprobs=logprobs, num_top=[0] * len(ids))


def test_on_the_cpu_the_ids_are_read_where_they_are() -> None:
    copy = SampledTokenCopy(torch.device("cpu"))
    tokens = copy.start(_output([5, 7, 9], torch.device("cpu")), {"a": 0, "b": 1, "c": 2})
    assert tokens.host_ids() == [5, 7, 9]
    assert tokens.device_ids.data_ptr() == tokens.output.sampled.data_ptr()
    assert tokens.row_of["b"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory)")
def test_on_cuda_two_pinned_buffers_take_turns_and_grow() -> None:
    device = torch.device("cuda")
    copy = SampledTokenCopy(device)
    steps = [list(range(i, i + 300 * (i + 1))) for i in range(3)]  # the third grows a buffer
    launched = [copy.start(_output(ids, device), {}) for ids in steps[:2]]
    # Both in flight at once, as under async scheduling: each reads its own.
    assert [t.host_ids() for t in launched] == steps[:2]
    third = copy.start(_output(steps[2], device), {})
    assert third.host_ids() == steps[2]
    assert third.device_ids.is_cuda
    assert third.output.logprobs is not None
    assert not third.output.logprobs.is_cuda
    assert third.output.logprobs.is_pinned()
