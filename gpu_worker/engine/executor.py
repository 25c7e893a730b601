"""The executor seam: where a step's model work runs, over one rank or a TP group.

As vLLM v1's `Executor`: the engine hands a `SchedulerOutput` to `execute` and gets the
step's logits (and scored prompt logprobs) back, whatever the parallelism. `LocalExecutor`
runs the one runner; `TPExecutor` is rank 0 of a tensor-parallel group, which releases
what finished, prepares the step, broadcasts it to its followers and runs its own shard
(gpu_worker.engine.tp_step), inside the window where no idle message may reach them.
`start_executor` builds either from the config, the rank's model and runner coming from
the engine's `build` (the same for every rank: gpu_worker.engine.rank).

Async scheduling needs the previous step's sampled ids on the device as inputs; only the
local executor takes them (`takes_device_inputs`): followers never see rank 0's samples,
so a TP group's steps run in order.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from gpu_worker.core.config import EngineConfig
from gpu_worker.core.scheduler import SchedulerOutput
from gpu_worker.distributed.group import TPGroup
from gpu_worker.engine.prompt_scoring import score_step_prompts
from gpu_worker.engine.tp_worker import TPLeader
from gpu_worker.lora.manager import LoRARegistry
from gpu_worker.runner.device import resolve_device
from gpu_worker.runner.model_runner import ModelRunner, PreviousTokens, RunnerOutput

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs each step's model work; `close` ends whatever it started."""

    runner: ModelRunner
    takes_device_inputs: bool
    """Whether `execute` may take the previous step's samples on the device."""

    def execute(
        self, output: SchedulerOutput, previous: PreviousTokens | None = None
    ) -> RunnerOutput | None:
        """Release what left the running set and run the scheduled batch, scoring its
        prompt-logprob rows into their sequences; None when nothing is scheduled."""
        ...

    def close(self) -> None: ...


class LocalExecutor:
    """One rank: the runner in this process."""

    takes_device_inputs = True

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size

    def execute(
        self, output: SchedulerOutput, previous: PreviousTokens | None = None
    ) -> RunnerOutput | None:
        # Before this step's rows are laid out: an id that left may be back as a new request.
        self.runner.release(output.finished_request_ids)
        if output.is_empty:
            return None
        run = self.runner.execute(output.scheduled, previous)
        if run.prompt_hidden is not None:
            score_step_prompts(
                output.scheduled, run.prompt_hidden, self.runner.compute_logits, self.vocab_size
            )
        return run

    def close(self) -> None:
        pass


class TPExecutor:
    """Rank 0 of a tensor-parallel group leading its followers' steps."""

    takes_device_inputs = False

    def __init__(
        self,
        leader: TPLeader,
        runner: ModelRunner,
        vocab_size: int,
        lora: LoRARegistry | None,
    ) -> None:
        self.leader = leader
        self.runner = runner
        self.vocab_size = vocab_size
        self.lora = lora
        self._released: list[str] = []
        atexit.register(self.close)

    def execute(
        self, output: SchedulerOutput, previous: PreviousTokens | None = None
    ) -> RunnerOutput | None:
        if previous is not None:
            raise ValueError("a tensor-parallel step takes no inputs on rank 0's device")
        # The followers release with the next step they run, whichever step that is.
        self._released.extend(output.finished_request_ids)
        if output.is_empty:
            return None
        released, self._released = self._released, []
        # The forward and the prompt scoring's gathers are collectives: rank 0's idle
        # messages to its followers wait for them.
        with self.leader.leading():
            run = self.leader.step(self.runner, output.scheduled, released, self.lora)
            if run.prompt_hidden is not None:
                score_step_prompts(
                    output.scheduled, run.prompt_hidden, self.runner.compute_logits, self.vocab_size
                )
        return run

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        self.leader.close()
        # atexit's reference would keep a closed engine's model alive until exit.
        atexit.unregister(self.close)


class BuiltRank(Protocol):
    """What the engine's `build` gives `start_executor`: the rank's runner and, with
    LoRA on, its registry."""

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def lora_registry(self) -> LoRARegistry | None: ...

    @property
    def vocab_size(self) -> int: ...


Built = TypeVar("Built", bound=BuiltRank)


def start_executor(
    config: EngineConfig, build: Callable[[TPGroup], Built]
) -> tuple[Executor, Built]:
    """Build this process's rank with `build` over its group and the executor that runs
    its steps: at TP > 1 this process is rank 0, which first starts the node's other
    ranks (each builds its shard as this one does) and stops them on any failure."""
    if config.tensor_parallel_size == 1:
        built = build(TPGroup.single(resolve_device(config.device)))
        return LocalExecutor(built.runner, built.vocab_size), built
    leader = TPLeader(config)
    with leader.starting():
        built = build(leader.group)
    leader.started()
    return TPExecutor(leader, built.runner, built.vocab_size, built.lora_registry), built
