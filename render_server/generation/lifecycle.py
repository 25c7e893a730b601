"""One HTTP request's generation, the lifecycle every generating endpoint uses.

A `Generation` holds every choice of a request: `n` per prompt, for one prompt (chat) or
several (completions). `start()` submits one `Generate` per choice (choice i of a seeded
request gets seed + i); `deltas()` turns each worker delta into text with an
IncrementalDetokenizer, cuts stop strings (aborting the worker request when one matches)
and yields `ChoiceDelta`s of every choice in arrival order; `aclose()` aborts whatever
still runs and records the request's metrics, once. Endpoints only format what it yields.
`accepted()` waits until the workers took every choice (an HTTP status can wait for it);
`stop(error)` ends every choice with an error: the request's deadline (`timeout_s`) and a
drain that ran out of time use it, so such a request still ends with one error.

Each piece of a choice's output has one owner: its `RequestStream` keeps the token ids
(a failover resends them), its detokenizer the text, the `Choice` the logprobs and how it
finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from render_server.generation.detokenizer import IncrementalDetokenizer
from render_server.templating.tokenizer import Tokenizer
from render_server.worker_client.pool import RequestStream, WorkerError, WorkerPool
from shared.protocol import Constraint, FinishReason, Generate, RequestDelta, TokenLogprobs
from shared.sampling import SamplingParams


@dataclass(frozen=True)
class ChoiceSpec:
    """How to generate one choice."""

    sampling: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool


@dataclass(frozen=True)
class PromptSpec:
    """One prompt and how to generate each of its choices."""

    prompt_token_ids: list[int]
    choices: list[ChoiceSpec]


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta; `index` is the choice's position in
    the request (prompt index * n + choice index)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationTimings:
    """When things happened, for TTFT / ITL / E2E metrics."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class UsageCounts:
    """Token counts of a whole request: prompts once each, every choice's output."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerationRecorder(Protocol):
    """Observes a request once it ended (render_server.generation.metrics provides it)."""

    def record(self, generation: Generation) -> None: ...


class PromptGeneration:
    """The choices that share one prompt: the unit TTFT, queue time and cache hits are
    measured on."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], arrival: float) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.timings = GenerationTimings(arrival=arrival)
        self.num_cached_tokens = 0
        self.queue_time: float | None = None
        """Seconds the first choice waited in its worker's queue, as the worker reports it."""
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        """Per prompt token (None for the first), when the request asked for them (every
        choice computes the same)."""
        self.choices: list[Choice] = []

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)

    def observe(self, delta: RequestDelta) -> None:
        """Note a delta's arrival time, cache hits and queue time."""
        now = time.perf_counter()
        timings = self.timings
        if timings.first_token is None:
            timings.first_token = now
        elif timings.last_token is not None:
            timings.inter_token.append(now - timings.last_token)
        timings.last_token = now
        if delta.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if self.queue_time is None:
            self.queue_time = delta.queue_time
        if delta.prompt_logprobs is not None:  # only a choice's first delta has them
            self.prompt_logprobs = delta.prompt_logprobs


class Choice:
    """One sampled sequence: its worker stream, its detokenizer, and how it ended."""

    def __init__(
        self,
        index: int,
        spec: ChoiceSpec,
        prompt: PromptGeneration,
        tokenizer: Tokenizer,
    ) -> None:
        self.index = index
        self.spec = spec
        self.prompt = prompt
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=spec.skip_special_tokens,
            stop=spec.stop,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            prompt_token_ids=prompt.prompt_token_ids,
        )
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.stream: RequestStream | None = None
        """Set once submitted."""
        self._replayed_ids: list[int] = []
        """The token ids fed by `replay` (a choice with no stream: a derender)."""
        self._num_ids_seen = 0
        """Token ids of the deltas `on_delta` took so far."""
        self._num_ids_kept: int | None = None
        """When a stop string ended it: how many token ids count. Ids after the one whose
        text completed it (in the same delta, or received before the abort took) are not
        output: one id per delta would have stopped before them."""
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def token_ids(self) -> list[int]:
        """Every token id generated so far (the stream owns them; `replay` when none), up to
        the one that completed a stop string."""
        ids = self.stream.output_token_ids if self.stream is not None else self._replayed_ids
        kept = self._num_ids_kept
        return ids if kept is None or kept == len(ids) else ids[:kept]

    def replay(self, delta: RequestDelta) -> ChoiceDelta:
        """`on_delta` for a choice generated elsewhere (a derender: no stream, no worker):
        its token ids are kept here."""
        if self.stream is not None:
            raise RuntimeError("a submitted choice's deltas come from its stream")
        self._replayed_ids.extend(delta.new_token_ids)
        return self.on_delta(delta)

    @property
    def text(self) -> str:
        """Everything detokenized and released so far (the detokenizer owns it)."""
        return self.detokenizer.output_text

    def on_delta(self, delta: RequestDelta) -> ChoiceDelta:
        """A worker delta as text: stop strings cut, held-back text flushed at the end.

        A stop string ends the token ids and logprobs too, at the id whose text completed
        it: a delta of several ids (a speculative step) gives what one id per delta gives."""
        self.prompt.observe(delta)
        detokenizer = self.detokenizer
        finish_reason = delta.finish_reason
        token_ids = ids = delta.new_token_ids
        logprobs = delta.logprobs
        num_ids_before = self._num_ids_seen
        self._num_ids_seen += len(ids)
        if finish_reason is not None and self._ends_with_stop_token(delta):
            ids = ids[:-1]  # as in vLLM: in token_ids and logprobs, not in the text
        update = detokenizer.add(ids)
        text = update.text
        stop_reason: int | str | None = delta.stop_token_id
        if update.finished_by_stop:
            finish_reason, stop_reason = "stop", update.stop_str
            kept = len(ids) if update.num_ids_kept is None else update.num_ids_kept
            self._num_ids_kept = num_ids_before + kept
            if kept < len(token_ids):  # later ids go, a stop token ending the delta too
                token_ids = token_ids[:kept]
                logprobs = logprobs[:kept] if logprobs is not None else None
        elif finish_reason is not None:
            text += detokenizer.flush()
            if detokenizer.stop_str is not None:
                finish_reason, stop_reason = "stop", detokenizer.stop_str
        if logprobs:
            self.logprobs.extend(logprobs)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return ChoiceDelta(self.index, text, token_ids, logprobs, finish_reason, stop_reason)

    def _ends_with_stop_token(self, delta: RequestDelta) -> bool:
        """Whether the worker ended `delta` on a stop token whose text is left out: it ends
        "stop" on EOS or a stop_token_ids entry (the last id), or on a completed grammar
        (the last id is output)."""
        ids = delta.new_token_ids
        return (
            delta.finish_reason == "stop"
            and bool(ids)
            and not self.spec.include_stop_str_in_output
            and (delta.stop_token_id is not None or ids[-1] in self.eos_token_ids)
        )


class Generation:
    """Every choice of one request, from submission to its metrics.

    Use `async with generation:` or `await start()` ... `await aclose()`: closing early
    (client gone, error) aborts whatever is still running on the workers. `start()` raises
    `WorkerError` when a choice cannot be submitted (having aborted the others).
    """

    def __init__(
        self,
        pool: WorkerPool | None,
        tokenizer: Tokenizer,
        request_id: str,
        prompts: list[PromptSpec],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        worker_request_id: str | None = None,
        arrival_time: float | None = None,
        constraint: Constraint | None = None,
        recorder: GenerationRecorder | None = None,
        timeout_s: float | None = None,
        live: set[Generation] | None = None,
    ) -> None:
        self.pool = pool
        """None for a generation replayed from token ids (`Choice.replay`): never started."""
        self.request_id = request_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        """The LoRA adapter every choice runs with; None for the base model."""
        self.constraint = constraint
        """Structured output every choice is held to (validated by
        render_server.generation.structured)."""
        arrival = arrival_time or time.perf_counter()
        self.prompts: list[PromptGeneration] = []
        self.choices: list[Choice] = []
        """Every choice, prompt by prompt: `choices[i].index == i`."""
        base_id = worker_request_id or request_id
        for number, prompt_spec in enumerate(prompts):
            prompt_id = base_id if len(prompts) == 1 else f"{base_id}-{number}"
            prompt = PromptGeneration(prompt_id, prompt_spec.prompt_token_ids, arrival)
            self.prompts.append(prompt)
            for spec in prompt_spec.choices:
                choice = Choice(len(self.choices), spec, prompt, tokenizer)
                prompt.choices.append(choice)
                self.choices.append(choice)
        self._recorder = recorder
        self._closed = False
        self._timeout_s = timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._live = live
        """The generations of this server still open (a drain stops what remains)."""
        self._aborted = False
        self.close_callbacks: list[Callable[[Generation], None]] = []
        """Called once, when it closes: a registry of live requests forgets it there."""

    async def start(self) -> None:
        """Submit every choice to the workers; the deadline, if any, runs from here."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("a replayed generation has no workers to start on")
        if self._live is not None:
            self._live.add(self)
        if self._timeout_s is not None:
            timeout_s = self._timeout_s
            error = WorkerError(
                "timeout", f"the request did not finish within {timeout_s:g}s (--request-timeout)"
            )
            self._deadline = asyncio.get_running_loop().call_later(timeout_s, self.stop, error)
        try:
            for prompt in self.prompts:
                for number, choice in enumerate(prompt.choices):
                    choice.stream = await pool.submit(
                        Generate(
                            request_id=f"{prompt.request_id}-{number}",
                            prompt_token_ids=prompt.prompt_token_ids,
                            sampling=choice.spec.sampling,
                            priority=self.priority,
                            cache_salt=self.cache_salt,
                            lora_name=self.lora_name,
                            arrival_time=time.time(),
                            constraint=self.constraint,
                        )
                    )
                    if self._aborted:  # an abort came while the earlier ones were sent
                        await choice.stream.abort()
        except BaseException:
            await self.aclose()
            raise

    async def accepted(self) -> None:
        """Return once a worker has taken every choice; raise the `WorkerError` of one
        that was refused (or lost, or stopped) first."""
        for choice in self.choices:
            if choice.stream is not None:
                await choice.stream.accepted()

    def stop(self, error: WorkerError) -> None:
        """Abort every choice still running; each ends with `error` (a consumer of
        `deltas()` gets it raised)."""
        for choice in self.choices:
            if choice.stream is not None:
                choice.stream.stop(error)

    async def abort(self) -> None:
        """Abort every choice still running on the workers (freeing their KV): each ends
        with finish_reason "abort", as a client's abort request asks. Choices submitted
        later (the abort came while `start` ran) are aborted as they are."""
        self._aborted = True
        for choice in self.choices:
            if choice.stream is not None:
                await choice.stream.abort()

    async def aclose(self) -> None:
        """Abort every choice still running; record the request's metrics (once)."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self._live is not None:
            self._live.discard(self)
        await self.abort()
        if not self._closed:
            self._closed = True
            for callback in self.close_callbacks:
                callback(self)
            if self._recorder is not None:
                self._recorder.record(self)

    async def __aenter__(self) -> Generation:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def worker_addresses(self) -> list[str]:
        """Where each submitted choice went."""
        return [c.stream.worker_address for c in self.choices if c.stream is not None]

    def usage(self) -> UsageCounts:
        prompt_tokens = completion_tokens = cached_tokens = 0
        for prompt in self.prompts:
            prompt_tokens += len(prompt.prompt_token_ids)
            completion_tokens += prompt.num_completion_tokens
            cached_tokens += prompt.num_cached_tokens
        return UsageCounts(prompt_tokens, completion_tokens, cached_tokens)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas, interleaved as they arrive; ends when all finished."""
        if len(self.choices) == 1:
            # The common case needs no task and no queue between worker and client.
            async for delta in _run_choice(self.choices[0]):
                yield delta
            return
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for delta in _run_choice(choice):
                    queue.put_nowait(delta)
            except BaseException as exc:  # re-raised in the consumer
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(choice)) for choice in self.choices]
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


async def _run_choice(choice: Choice) -> AsyncIterator[ChoiceDelta]:
    stream = choice.stream
    if stream is None:
        raise RuntimeError("the generation was not started")
    async for delta in stream:
        out = choice.on_delta(delta)
        if out.finish_reason is not None and delta.finish_reason is None:
            await stream.abort()  # a stop string ended it before the worker did
        yield out
        if out.finish_reason is not None:
            return
