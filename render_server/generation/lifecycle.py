"""One HTTP request's choices, running on the workers and detokenized as they stream.

`Generation` submits one `Generate` per choice (choice i of a seeded request gets seed + i),
turns each worker delta into text with an IncrementalDetokenizer, cuts stop strings (and
aborts the worker request when one matches), and yields `ChoiceDelta`s in arrival order.
The endpoints format those as SSE chunks or fold them into one JSON body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from render_server.generation.detokenizer import IncrementalDetokenizer
from render_server.templating.tokenizer import Tokenizer
from render_server.worker_client.pool import RequestStream, WorkerPool
from shared.protocol import Constraint, Generate, RequestDelta, TokenLogprobs
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class ChoiceSpec:
    """How to generate one choice."""

    sampling: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ChoiceTotals:
    """A choice's whole output, accumulated for non-streamed responses and usage."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationTimings:
    """When things happened, for TTFT / ITL / E2E metrics."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)


class Generation:
    """All choices of one request. Use as an async context manager: leaving it early
    (client gone, error) aborts whatever is still running on the workers."""

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer: Tokenizer,
        request_id: str,
        prompt_token_ids: list[int],
        choices: list[ChoiceSpec],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.choices = choices
        self.priority = priority
        self.cache_salt = cache_salt
        self.constraint = constraint
        """Structured output every choice is held to (validated by
        render_server.generation.structured)."""
        self.timings = GenerationTimings(arrival=arrival_time or time.perf_counter())
        self.totals = [ChoiceTotals() for _ in choices]
        self.num_cached_tokens = 0
        self.queue_time: float | None = None
        """Seconds the first choice waited in its worker's queue, as the worker reports it."""
        self._streams: list[RequestStream] = []

    async def __aenter__(self) -> Generation:
        try:
            for index, spec in enumerate(self.choices):
                stream = await self.pool.submit(
                    Generate(
                        request_id=f"{self.request_id}-{index}",
                        prompt_token_ids=self.prompt_token_ids,
                        sampling=spec.sampling,
                        priority=self.priority,
                        cache_salt=self.cache_salt,
                        arrival_time=time.time(),
                        constraint=self.constraint,
                    )
                )
                self._streams.append(stream)
        except BaseException:
            await self.abort()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.abort()

    async def abort(self) -> None:
        """Abort every choice still running (idempotent)."""
        for stream in self._streams:
            await stream.abort()

    @property
    def worker_addresses(self) -> list[str]:
        """Where each submitted choice went."""
        return [stream.worker_address for stream in self._streams]

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(total.token_ids) for total in self.totals)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas, interleaved as they arrive; ends when all finished."""
        if len(self._streams) == 1:
            async for delta in self._run_choice(0):
                yield delta
            return
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in self._run_choice(index):
                    queue.put_nowait(delta)
            except BaseException as exc:  # re-raised in the consumer
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self._streams))]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(self, index: int) -> AsyncIterator[ChoiceDelta]:
        spec = self.choices[index]
        stream = self._streams[index]
        totals = self.totals[index]
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=spec.skip_special_tokens,
            stop=spec.stop,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            prompt_token_ids=self.prompt_token_ids,
        )
        async for delta in stream:
            out = self._on_delta(index, delta, detokenizer, totals)
            if out.finish_reason is not None and delta.finish_reason is None:
                await stream.abort()  # a stop string ended it before the worker did
            yield out
            if out.finish_reason is not None:
                return

    def _on_delta(
        self,
        index: int,
        delta: RequestDelta,
        detokenizer: IncrementalDetokenizer,
        totals: ChoiceTotals,
    ) -> ChoiceDelta:
        now = time.perf_counter()
        timings = self.timings
        if timings.first_token is None:
            timings.first_token = now
        elif timings.last_token is not None:
            timings.inter_token.append(now - timings.last_token)
        timings.last_token = now
        if delta.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.queue_time is not None and self.queue_time is None:
            self.queue_time = delta.queue_time

        update = detokenizer.add(delta.new_token_ids)
        text = update.text
        finish_reason = delta.finish_reason
        stop_reason: int | str | None = delta.stop_token_id
        if update.finished_by_stop:
            finish_reason, stop_reason = "stop", update.stop_str
        elif finish_reason is not None:
            text += detokenizer.flush()
            if detokenizer.stop_str is not None:
                finish_reason, stop_reason = "stop", detokenizer.stop_str
        totals.text.append(text)
        totals.token_ids.extend(delta.new_token_ids)
        if delta.logprobs:
            totals.logprobs.extend(delta.logprobs)
        if finish_reason is not None:
            totals.finish_reason, totals.stop_reason = finish_reason, stop_reason
        return ChoiceDelta(
            index, text, delta.new_token_ids, delta.logprobs, finish_reason, stop_reason
        )
