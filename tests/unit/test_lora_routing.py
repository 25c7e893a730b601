"""LoRA in the render tier's worker pool: routing by the adapters each worker's heartbeat
reports, the loads a welcome triggers, and runtime load/unload across workers.

The workers are fake (tests/helpers/fake_worker): each welcomes with a LoRA-enabled card,
heartbeats the adapters the test gives it, and answers LoadLoRA/UnloadLoRA as told. The
pure policy (`adapter_holders`) is tested without sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import pytest

from render_server.worker_client.lora import LoRAModule, parse_lora_module
from render_server.worker_client.pool import WorkerPool
from render_server.worker_client.routing import (
    RoutingMode,
    WorkerLoad,
    adapter_holders,
    affinity_hashes,
)
from shared.model_card import ModelCard
from shared.protocol import (
    Generate,
    LoadLoRA,
    LoRAResult,
    RenderToWorker,
    UnloadLoRA,
    WorkerStats,
)
from shared.sampling import SamplingParams
from tests.helpers.fake_worker import FakeWorker, fake_workers
from tests.helpers.waiting import wait_until_async

CARD = ModelCard(
    model_id="fake",
    tokenizer_digest="f" * 64,
    vocab_size=1000,
    eos_token_ids=[2],
    max_model_len=4096,
    max_loras=2,
    max_lora_rank=16,
)
TEST_TIMEOUT_S = 20


# ---- the policy, without sockets ------------------------------------------------------


def test_resident_holders_win_then_registered_ones_then_anyone() -> None:
    workers = [
        WorkerLoad("none", 0),
        WorkerLoad("registered", 0, adapter="registered"),
        WorkerLoad("resident", 2, adapter="resident"),
    ]
    assert adapter_holders(workers) == [2]
    # Round robin keeps every worker that can serve it.
    assert adapter_holders(workers, resident_first=False) == [1, 2]
    # No slot holder: the registered ones; nobody registers it: everyone.
    assert adapter_holders(workers[:2]) == [1]
    assert adapter_holders([WorkerLoad("a", 3), WorkerLoad("b", 0)]) == [0, 1]


def test_a_busy_resident_holder_yields_to_a_registered_one_past_the_margin() -> None:
    busy = [
        WorkerLoad("resident", 5, adapter="resident"),
        WorkerLoad("registered", 0, adapter="registered"),
    ]
    assert adapter_holders(busy, margin=5) == [0]  # 5 <= 0 + 5
    assert adapter_holders(busy, margin=4) == [0, 1]  # a slot fill beats queueing


def test_adapters_hash_their_prompts_apart() -> None:
    prompt = list(range(64))
    base = affinity_hashes(_generate("r", prompt), 16)
    alpha = affinity_hashes(_generate("r", prompt, "alpha"), 16)
    assert len(base) == len(alpha) == 4
    assert not set(base) & set(alpha)
    assert affinity_hashes(_generate("s", prompt, "alpha"), 16) == alpha


def test_lora_module_forms() -> None:
    assert parse_lora_module("alpha=/adapters/a") == LoRAModule("alpha", "/adapters/a")
    text = '{"name": "beta", "path": "b=1", "base_model_name": "base"}'
    assert parse_lora_module(text) == LoRAModule("beta", "b=1", "base")
    for bad, problem in [
        ("{not json", "invalid JSON"),
        ('{"name": "x"}', "path"),
        ('{"name": "x", "path": "p", "rank": 8}', "rank"),
        ("=path", "name"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_lora_module(bad)


# ---- the pool, against fake workers ---------------------------------------------------


class FakeLoRAWorker(FakeWorker):
    """A fake worker that welcomes with `CARD`, heartbeats the adapters it registers and
    holds resident every 0.1 s, and answers each LoRA operation with `answer(operation)`:
    (status, message), or None to stay silent. A 200 changes what it registers, as a
    worker's would, unless `reports_changes` is off (its heartbeats then stay as stale as a
    heartbeat sent just before the change)."""

    def __init__(
        self,
        registered: list[str] | None = None,
        resident: list[str] | None = None,
        answer: Callable[[LoadLoRA | UnloadLoRA], tuple[int, str] | None] = lambda _: (200, "ok"),
        reports_changes: bool = True,
    ) -> None:
        super().__init__(CARD, heartbeat_interval_s=0.1)
        self.registered = list(registered or [])
        self.resident = list(resident or [])
        self.answer = answer
        self.reports_changes = reports_changes

    @property
    def operations(self) -> list[LoadLoRA | UnloadLoRA]:
        """The LoRA operations received, in order."""
        return [m for m in self.received if isinstance(m, LoadLoRA | UnloadLoRA)]

    def reply(self, message: RenderToWorker) -> LoRAResult | None:
        if not isinstance(message, LoadLoRA | UnloadLoRA):
            return None
        answer = self.answer(message)
        if answer is None:
            return None
        status, text = answer
        if status == 200 and self.reports_changes:
            if isinstance(message, LoadLoRA):
                self.registered.append(message.lora_name)
            else:
                self.registered.remove(message.lora_name)
        return LoRAResult(op_id=message.op_id, ok=status == 200, status=status, message=text)

    def stats(self) -> WorkerStats:
        return WorkerStats(lora_registered=list(self.registered), lora_resident=list(self.resident))


@contextlib.asynccontextmanager
async def started_pool(
    workers: tuple[FakeLoRAWorker, ...],
    *,
    routing: RoutingMode = "prefix",
    lora_modules: Sequence[LoRAModule] = (),
) -> AsyncIterator[WorkerPool]:
    pool = WorkerPool(
        [worker.endpoint for worker in workers],
        tokenizer_digest=CARD.tokenizer_digest,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=2.0,
        routing=routing,
        lora_modules=lora_modules,
    )
    await pool.start(5)
    try:
        # Every worker welcomed us and sent its adapters in a heartbeat.
        await wait_until_async(
            lambda: (
                all(status.stats is not None for status in pool.statuses())
                and len(pool.statuses()) == len(workers)
            ),
            5,
            "every worker's first heartbeat",
        )
        yield pool
    finally:
        await pool.close()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), TEST_TIMEOUT_S))


def _generate(request_id: str, prompt: list[int], lora_name: str | None = None) -> Generate:
    return Generate(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=4),
        lora_name=lora_name,
    )


def test_requests_go_to_the_worker_holding_their_adapter() -> None:
    holder_a = FakeLoRAWorker(registered=["alpha", "beta"], resident=["alpha"])
    holder_b = FakeLoRAWorker(registered=["alpha", "beta"], resident=["beta"])
    with fake_workers(holder_a, holder_b):

        async def main() -> None:
            async with started_pool((holder_a, holder_b)) as pool:
                assert pool.lora_adapters() == {"alpha": None, "beta": None}
                for number in range(6):
                    # Distinct prompts: no prefix affinity pulls them anywhere.
                    prompt = [number + 3] * 40
                    await pool.submit(_generate(f"a{number}", prompt, "alpha"))
                    await pool.submit(_generate(f"b{number}", prompt, "beta"))
                await wait_until_async(
                    lambda: len(holder_a.generates) + len(holder_b.generates) == 12,
                    5,
                    "all twelve requests",
                )
                assert {g.lora_name for g in holder_a.generates} == {"alpha"}
                assert {g.lora_name for g in holder_b.generates} == {"beta"}

        run(main)


def test_only_a_registering_worker_gets_the_adapter_even_when_busier() -> None:
    holder = FakeLoRAWorker(registered=["alpha"])
    other = FakeLoRAWorker()
    with fake_workers(holder, other):

        async def main() -> None:
            async with started_pool((holder, other)) as pool:
                for number in range(8):
                    await pool.submit(_generate(f"r{number}", [number + 3] * 20, "alpha"))
                await pool.submit(_generate("base", [7] * 20))
                await wait_until_async(
                    lambda: len(holder.generates) + len(other.generates) == 9, 5, "the requests"
                )
                assert len(holder.generates) == 8
                # The base request went where the load was: the other worker.
                assert [g.request_id for g in other.generates] == ["base"]

        run(main)


def test_round_robin_rotates_among_the_holders_only() -> None:
    workers = (
        FakeLoRAWorker(registered=["alpha"], resident=["alpha"]),
        FakeLoRAWorker(registered=["alpha"]),
        FakeLoRAWorker(),
    )
    with fake_workers(*workers):

        async def main() -> None:
            async with started_pool(workers, routing="round_robin") as pool:
                for number in range(4):
                    await pool.submit(_generate(f"r{number}", [5] * 20, "alpha"))
                await wait_until_async(
                    lambda: sum(len(w.generates) for w in workers) == 4, 5, "the requests"
                )
                assert [len(w.generates) for w in workers] == [2, 2, 0]

        run(main)


def test_a_welcome_loads_the_render_servers_adapters() -> None:
    fresh = FakeLoRAWorker()
    has_one = FakeLoRAWorker(
        registered=["alpha"],
        answer=lambda op: (409, "already loaded") if op.lora_name == "alpha" else (200, "ok"),
    )
    modules = [LoRAModule("alpha", "a"), LoRAModule("beta", "b")]
    with fake_workers(fresh, has_one):

        async def main() -> None:
            async with started_pool((fresh, has_one), lora_modules=modules) as pool:
                await wait_until_async(
                    lambda: len(fresh.operations) == len(has_one.operations) == 2, 5, "the loads"
                )
                for worker in (fresh, has_one):
                    assert [
                        (op.lora_name, op.lora_path)
                        for op in worker.operations
                        if isinstance(op, LoadLoRA)
                    ] == [("alpha", "a"), ("beta", "b")]
                assert pool.lora_adapters() == {"alpha": "a", "beta": "b"}

        run(main)


def test_runtime_load_and_unload_reach_every_worker() -> None:
    workers = (FakeLoRAWorker(), FakeLoRAWorker())
    with fake_workers(*workers):

        async def main() -> None:
            async with started_pool(workers) as pool:
                outcomes = await pool.load_lora("gamma", "g", timeout_s=5)
                assert [outcome.ok for outcome in outcomes] == [True, True]
                assert pool.lora_adapters() == {"gamma": "g"}
                assert all(
                    status.stats is not None and "gamma" in status.stats.lora_registered
                    for status in pool.statuses()
                ), "routing sees the adapter on every worker"
                outcomes = await pool.unload_lora("gamma", timeout_s=5)
                assert [outcome.status for outcome in outcomes] == [200, 200]
                assert pool.lora_adapters() == {}
                for worker in workers:
                    assert [type(op) for op in worker.operations] == [LoadLoRA, UnloadLoRA]

        run(main)


def test_a_load_that_fails_anywhere_is_rolled_back_everywhere() -> None:
    good = FakeLoRAWorker()
    bad = FakeLoRAWorker(answer=lambda op: (404, "no adapter there"))
    with fake_workers(good, bad):

        async def main() -> None:
            async with started_pool((good, bad)) as pool:
                outcomes = await pool.load_lora("gamma", "g", timeout_s=5)
                assert sorted(outcome.status for outcome in outcomes) == [200, 404]
                assert pool.lora_adapters() == {}
                assert [type(op) for op in good.operations] == [LoadLoRA, UnloadLoRA]
                assert [type(op) for op in bad.operations] == [LoadLoRA]

        run(main)


def test_a_silent_worker_is_a_timeout_not_a_hang() -> None:
    silent = FakeLoRAWorker(answer=lambda op: None)
    with fake_workers(silent):

        async def main() -> None:
            async with started_pool((silent,)) as pool:
                started = time.monotonic()
                outcomes = await pool.load_lora("gamma", "g", timeout_s=0.3)
                assert time.monotonic() - started < 2
                assert [(outcome.ok, outcome.status) for outcome in outcomes] == [(False, 504)]

        run(main)


def test_a_heartbeat_from_before_a_change_does_not_undo_it() -> None:
    stale = FakeLoRAWorker(registered=["gamma"], reports_changes=False)
    with fake_workers(stale):

        async def main() -> None:
            async with started_pool((stale,)) as pool:
                await pool.unload_lora("gamma", timeout_s=5)
                await pool.load_lora("delta", "d", timeout_s=5)
                beats = pool.statuses()[0].last_heartbeat
                await wait_until_async(
                    lambda: pool.statuses()[0].last_heartbeat > beats, 2, "a later heartbeat"
                )
                assert pool.lora_adapters() == {"delta": "d"}
                stats = pool.statuses()[0].stats
                assert stats is not None
                assert stats.lora_registered == ["delta"]

        run(main)
