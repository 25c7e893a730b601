"""One step of a TP group: rank 0 prepares the batch, broadcasts it, and every rank runs it.

Rank 0 alone owns the scheduler, the sequences and the block table's bookkeeping, so only
it can `prepare` a step. What the other ranks (followers) need to run the same forward is
the prepared `HostBatch`: token ids, the batch layout (positions, slot mapping, sequence
boundaries), the block table's rows and this step's writes to it, the rows to sample and
the prompt-logprob rows. `encode_step` packs it into one `StepMessage` of raw array bytes,
`broadcast_step` carries it over the host group, and each follower rebuilds the batch and
runs it through `ModelRunner.execute_host`, as rank 0 does its own: the block-table writes
land alike on every rank, so every rank's table stays rank 0's. Followers do not sample;
their logits (only rank 0 gets full ones once the LM head gathers) are dropped. A step
with prompt-logprob rows ends, on rank 0, in their scoring, whose logits are gathers too:
each follower joins them (`follow_prompt_scoring`) before it waits for the next step.

With LoRA, rank 0 makes the step's adapters resident in its slots first, and the step
carries each sequence's slot and what changed in rank 0's registry since the last step
(`LoRASync`: the adapters unregistered, the slots filled and from which path); a
follower's `LoRAMirror` repeats the changes on its own slots before it runs the step.

Between steps a follower waits in the host group's broadcast, which fails once the group
timeout passes with nothing sent: an idle engine would lose its followers. `IdleKeepAlive`
sends them an empty message whenever rank 0 has sent nothing for a while; a follower
takes it and goes on waiting.

Over a world of 1, `lead_step` is `prepare` plus `execute_host`: nothing is encoded.

The wire is data only (msgspec, typed decoding): arrays travel as bytes with their dtype
and shape, and decoding checks that the bytes fill the shape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

from gpu_worker.attention.metadata import BatchLayout
from gpu_worker.core.scheduler import ScheduledSequence
from gpu_worker.distributed.comm import broadcast_step
from gpu_worker.distributed.group import TPGroup
from gpu_worker.lora.manager import LoRAMirror, LoRARegistry, LoRASync
from gpu_worker.runner.block_table import BlockTableStep
from gpu_worker.runner.model_runner import HostBatch, ModelRunner, RunnerOutput
from gpu_worker.sampling.prompt_logprobs import follow_prompt_scoring

logger = logging.getLogger(__name__)

WireDType = Literal["int64", "int32"]


class WireArray(msgspec.Struct, array_like=True, frozen=True):
    """A 1-D numpy array as raw bytes (native byte order: every rank runs on one kind of
    host)."""

    dtype: WireDType
    length: int
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> WireArray:
        dtype: WireDType = "int64" if array.dtype == np.int64 else "int32"
        if array.dtype != np.dtype(dtype) or array.ndim != 1:
            raise TypeError(f"only 1-D int64/int32 arrays cross, not {array.dtype} {array.shape}")
        return cls(dtype, int(array.shape[0]), np.ascontiguousarray(array).tobytes())

    def to_numpy(self) -> np.ndarray:
        dtype = np.dtype(self.dtype)
        if self.length < 0 or len(self.data) != self.length * dtype.itemsize:
            raise ValueError(f"{len(self.data)} bytes do not hold {self.length} {self.dtype}")
        # A copy: frombuffer over bytes is read-only, and the runner may write its arrays.
        return np.frombuffer(self.data, dtype=dtype).copy()


class StepMessage(msgspec.Struct, array_like=True, frozen=True):
    """One step as it crosses from rank 0 to the others; `stop` alone ends the followers."""

    stop: bool = False
    input_ids: WireArray | None = None
    query_start_loc: WireArray | None = None
    seq_lens: WireArray | None = None
    context_lens: WireArray | None = None
    positions: WireArray | None = None
    slot_mapping: WireArray | None = None
    max_query_len: int = 0
    max_seq_len: int = 0
    table_rows: WireArray | None = None
    """Each sequence's block-table row, in batch order."""
    table_width: int = 0
    write_index: WireArray | None = None
    """Flat positions in a table of `table_shape` written this step, and their values."""
    write_values: WireArray | None = None
    table_shape: tuple[int, int] = (0, 0)
    sample_rows: WireArray | None = None
    prompt_rows: WireArray | None = None
    released: list[str] = msgspec.field(default_factory=list)
    """Requests rank 0 released before preparing this step (the scheduler's
    `finished_request_ids`): a follower releases them too, keeping its runner's per-request
    state rank 0's."""
    adapter_slots: WireArray | None = None
    """Each sequence's LoRA slot (-1: the base model); None for a base-only step."""
    lora: LoRASync | None = None
    """Rank 0's registry and slot changes since the last step (None: LoRA is off)."""


@dataclass(frozen=True)
class FollowerStep:
    """A decoded step: the batch to run, the requests to release before it, and its LoRA
    slots and slot changes."""

    batch: HostBatch
    released: list[str]
    adapter_slots: np.ndarray | None = None
    lora: LoRASync | None = None


_decoder = msgspec.msgpack.Decoder(StepMessage)
_encoder = msgspec.msgpack.Encoder()


def encode_step(
    batch: HostBatch,
    released: list[str],
    adapter_slots: np.ndarray | None = None,
    lora: LoRASync | None = None,
) -> bytes:
    """The bytes rank 0 broadcasts for `batch`, prepared after releasing `released`, with
    its sequences' LoRA slots and the slot changes `lora` made before it."""
    layout, table = batch.layout, batch.table
    return _encoder.encode(
        StepMessage(
            input_ids=WireArray.of(batch.input_ids),
            query_start_loc=WireArray.of(layout.query_start_loc),
            seq_lens=WireArray.of(layout.seq_lens),
            context_lens=WireArray.of(layout.context_lens),
            positions=WireArray.of(layout.positions),
            slot_mapping=WireArray.of(layout.slot_mapping),
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            table_rows=WireArray.of(table.rows),
            table_width=table.width,
            write_index=WireArray.of(table.index),
            write_values=WireArray.of(table.values),
            table_shape=batch.table_shape,
            sample_rows=None if batch.sample_rows is None else WireArray.of(batch.sample_rows),
            prompt_rows=None if batch.prompt_rows is None else WireArray.of(batch.prompt_rows),
            released=list(released),
            adapter_slots=None if adapter_slots is None else WireArray.of(adapter_slots),
            lora=lora,
        )
    )


def encode_stop() -> bytes:
    """The message that ends every follower's loop."""
    return _encoder.encode(StepMessage(stop=True))


def decode_step(payload: bytes) -> FollowerStep | None:
    """The step `payload` carries, or None for the stop message. Raises
    `msgspec.ValidationError`/`ValueError` on bytes that are not a whole step."""
    message = _decoder.decode(payload)
    if message.stop:
        return None
    layout = BatchLayout(
        _array(message.query_start_loc),
        _array(message.seq_lens),
        _array(message.context_lens),
        _array(message.positions),
        _array(message.slot_mapping),
        message.max_query_len,
        message.max_seq_len,
    )
    table = BlockTableStep(
        _array(message.table_rows),
        message.table_width,
        _array(message.write_index),
        _array(message.write_values),
    )
    batch = HostBatch(
        _array(message.input_ids),
        layout,
        table,
        None if message.sample_rows is None else message.sample_rows.to_numpy(),
        None if message.prompt_rows is None else message.prompt_rows.to_numpy(),
        message.table_shape,
    )
    adapter_slots = None if message.adapter_slots is None else message.adapter_slots.to_numpy()
    if adapter_slots is not None and len(adapter_slots) != len(layout.seq_lens):
        raise ValueError(f"{len(adapter_slots)} adapter slots for {len(layout.seq_lens)} sequences")
    return FollowerStep(batch, message.released, adapter_slots, message.lora)


def _array(wire: WireArray | None) -> np.ndarray:
    if wire is None:
        raise ValueError("a step message lacks one of its arrays")
    return wire.to_numpy()


def lead_step(
    runner: ModelRunner,
    group: TPGroup,
    scheduled: list[ScheduledSequence],
    released: list[str],
    lora: LoRARegistry | None = None,
) -> RunnerOutput:
    """Rank 0's step: release `released` (the scheduler's `finished_request_ids`), prepare
    `scheduled` and make its adapters resident (`lora`: the runner's registry, when LoRA
    is on), send it to the followers, and run it. Returns rank 0's output."""
    runner.release(released)
    batch = runner.prepare(scheduled)
    adapter_slots = runner.adapter_slots(scheduled)
    if group.world_size > 1:
        sync = None if lora is None else lora.take_sync()
        broadcast_step(group, encode_step(batch, released, adapter_slots, sync))
    return runner.execute_host(batch, adapter_slots)


def stop_followers(group: TPGroup) -> None:
    """Rank 0's last step: end every follower's `follower_loop`."""
    if group.world_size > 1:
        broadcast_step(group, encode_stop())


def follower_loop(runner: ModelRunner, group: TPGroup, lora: LoRAMirror | None = None) -> int:
    """A follower's life: receive each step rank 0 leads and run the same forward, until
    the stop message; `lora` (when LoRA is on) mirrors rank 0's slots, which the runner's
    model reads. Returns the number of steps run."""
    if group.is_driver:
        raise ValueError("rank 0 leads the steps; only the other ranks follow")
    num_steps = 0
    while True:
        payload = broadcast_step(group, None)
        if not payload:  # rank 0 is idle (`IdleKeepAlive`): wait again
            continue
        step = decode_step(payload)
        if step is None:
            break
        runner.release(step.released)
        if step.lora is not None:
            if lora is None:
                raise RuntimeError("rank 0 serves LoRA adapters but this rank has no slots")
            lora.apply(step.lora)
        output = runner.execute_host(step.batch, step.adapter_slots)
        if output.prompt_hidden is not None:  # rank 0 scores these rows after the step
            follow_prompt_scoring(output.prompt_hidden, runner.compute_logits)
        num_steps += 1
    return num_steps


class IdleKeepAlive:
    """Rank 0's messages to idle followers: a thread that broadcasts an empty payload when
    rank 0 has sent nothing for `interval_s` (a fraction of the group timeout), so the
    follower's wait for the next step never reaches that timeout. Rank 0 sends its own
    steps inside `sending()`, which holds the thread off: the host group carries one
    message at a time, in order."""

    def __init__(self, group: TPGroup, interval_s: float) -> None:
        self.group = group
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-keep-alive", daemon=True)
        if group.world_size > 1:
            self._thread.start()

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Rank 0 sends a step (or the stop message) meanwhile."""
        with self._lock:
            try:
                yield
            finally:
                self._last_sent = time.monotonic()

    def stop(self) -> None:
        """End the thread (idempotent); rank 0 sends nothing more through it."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s / 2):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last_sent < self.interval_s:
                    continue
                try:
                    broadcast_step(self.group, b"")
                except Exception as exc:  # a dead rank: rank 0's next step reports it
                    logger.warning("could not reach every follower while idle: %s", exc)
                    return
                self._last_sent = time.monotonic()
