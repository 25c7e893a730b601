"""The executor seam (gpu_worker.engine.executor): the same `SchedulerOutput` run by the
`LocalExecutor` and by the `TPExecutor` of a 2-rank gloo group gives the same logits, step
after step, with prompt logprobs scored through either; what left the running set is
released before a step; a TP group takes no device inputs, so async scheduling runs its
steps in order, with TP=1's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.core.scheduler import SchedulerOutput
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.executor import LocalExecutor, TPExecutor
from shared.protocol import Generate, TokenLogprobs
from shared.sampling import SamplingParams
from tests.helpers.runner_output import runner_output

PROMPTS = [list(range(3, 23)), [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import save_tiny_model  # transformers

    out_dir = tmp_path_factory.mktemp("executor") / "qwen3"
    return save_tiny_model(out_dir, "qwen3", tokenizer="words").path


def _add(engine: Engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        sampling = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1 if i == 0 else None
        )
        engine.add_request(Generate(request_id=f"r{i}", prompt_token_ids=prompt, sampling=sampling))


def _greedy(output: SchedulerOutput, logits: torch.Tensor) -> dict[str, int]:
    rows = [item.seq.request_id for item in output.scheduled if item.will_sample]
    return dict(zip(rows, logits.argmax(dim=1).tolist(), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_local_and_tp_executors_run_the_same_steps(tiny_qwen3: Path) -> None:
    with (
        Engine(model=str(tiny_qwen3), device="cpu") as local,
        Engine(
            model=str(tiny_qwen3), device="cpu", tensor_parallel_size=2, dist_timeout_s=20.0
        ) as tp,
    ):
        assert isinstance(local.executor, LocalExecutor)
        assert isinstance(tp.executor, TPExecutor)
        assert local.executor.takes_device_inputs
        assert not tp.executor.takes_device_inputs
        for engine in (local, tp):
            _add(engine)
        for _ in range(4):
            outputs = [engine.scheduler.schedule() for engine in (local, tp)]
            runs = [
                engine.executor.execute(output)
                for engine, output in zip((local, tp), outputs, strict=True)
            ]
            assert runs[0] is not None
            assert runs[1] is not None
            torch.testing.assert_close(runs[1].logits, runs[0].logits, rtol=1e-4, atol=1e-4)
            tokens = _greedy(outputs[0], runs[0].logits)
            for engine, output in zip((local, tp), outputs, strict=True):
                engine.scheduler.update(output, runner_output(tokens))
        scored = [
            engine.scheduler.requests["r0"].sampler_state.prompt_logprobs for engine in (local, tp)
        ]
        assert scored[0] is not None
        assert len(scored[0]) == len(PROMPTS[0])
        assert scored[1] is not None
        _assert_same_logprobs(scored[0], scored[1])
        # Nothing scheduled: nothing runs. The local runner releases what finished at
        # once; a TP group releases with its next step, on every rank alike.
        for engine in (local, tp):
            engine.abort(["r0", "r1"])
            output = engine.scheduler.schedule()
            assert output.finished_request_ids == ["r0", "r1"]
            assert engine.executor.execute(output) is None
        assert local.runner.block_table.num_live_rows == 0
        assert tp.runner.block_table.num_live_rows == 2
        tp.add_request(
            Generate(request_id="r2", prompt_token_ids=PROMPTS[1], sampling=SamplingParams())
        )
        assert tp.executor.execute(tp.scheduler.schedule()) is not None
        assert tp.runner.block_table.num_live_rows == 1
        with pytest.raises(ValueError, match="no inputs on rank 0's device"):
            tp.executor.execute(SchedulerOutput(), previous=_Previous())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_async_scheduling_at_tp2_runs_in_order_with_tp1s_tokens(tiny_qwen3: Path) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True),
    ]
    with Engine(model=str(tiny_qwen3), device="cpu") as local:
        want = [c.token_ids for c in local.generate(PROMPTS, params)]
    with Engine(
        model=str(tiny_qwen3),
        device="cpu",
        tensor_parallel_size=2,
        dist_timeout_s=20.0,
        async_scheduling=True,
    ) as tp:
        assert not tp.async_scheduling
        assert [c.token_ids for c in tp.generate(PROMPTS, params)] == want


class _Previous:
    device_ids = torch.zeros(1, dtype=torch.long)
    row_of = {"x": 0}


def _assert_same_logprobs(
    want: list[TokenLogprobs | None], got: list[TokenLogprobs | None]
) -> None:
    assert len(got) == len(want)
    assert want[0] is None
    assert got[0] is None
    for w, g in zip(want[1:], got[1:], strict=True):
        assert w is not None
        assert g is not None
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert g.top_token_ids == w.top_token_ids
