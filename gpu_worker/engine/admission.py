"""The one place a request is checked before it runs: the scheduler and the sampler
trust it after. A refusal is a `RequestRejected` with the wire's code."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.core.config import EngineConfig
from gpu_worker.core.scheduler import Scheduler
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.lora.manager import LoRARegistry
from gpu_worker.sampling.structured import RequestMatcher, StructuredOutputs
from shared.constraints import ConstraintError
from shared.protocol import Generate
from shared.sampling import SamplingParamsError


@dataclass(frozen=True)
class Admission:
    """What a request is checked against: the engine's limits, vocabulary and adapters."""

    config: EngineConfig
    scheduler: Scheduler
    vocab_size: int
    lora: LoRARegistry | None
    structured: StructuredOutputs

    def check(self, request: Generate, key: str) -> RequestMatcher | None:
        """Raise RequestRejected if the request cannot run here; return its grammar
        matcher when it has a constraint."""
        if key in self.scheduler.requests:
            raise RequestRejected("duplicate", f"request {request.request_id!r} is running")
        prompt = request.prompt_token_ids
        if max(prompt, default=0) >= self.vocab_size:
            raise RequestRejected(
                "invalid_request",
                f"prompt_token_ids hold an id outside the vocabulary [0, {self.vocab_size})",
            )
        try:
            request.sampling.validate(self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestRejected("invalid_request", exc.message) from exc
        self._check_adapter(request.lora_name)
        if request.priority != 0 and self.config.scheduling_policy == "fcfs":
            raise RequestRejected(
                "invalid_request",
                "priority is not honoured by this worker (--scheduling-policy fcfs): send 0",
            )
        reason = self.scheduler.check_admissible(len(prompt), request.sampling.max_tokens)
        if reason is not None:
            # An empty prompt is malformed rather than too long; the wire forbids it too.
            raise RequestRejected("too_long" if prompt else "invalid_request", reason)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise RequestRejected("queue_full", "the worker's queue is full")
        if request.constraint is None:
            return None
        try:  # the render tier checked it; a worker re-checks
            return self.structured.new_matcher(request.constraint, prompt)
        except ConstraintError as exc:
            raise RequestRejected("invalid_request", f"constraint: {exc.message}") from exc

    def _check_adapter(self, lora_name: str | None) -> None:
        if lora_name is None:
            return
        if self.lora is None:
            raise RequestRejected(
                "lora_disabled",
                f"the request names LoRA adapter {lora_name!r} but this worker "
                "runs without --enable-lora",
            )
        if lora_name not in self.lora:
            raise RequestRejected(
                "lora_not_found", f"no LoRA adapter named {lora_name!r} is loaded"
            )
