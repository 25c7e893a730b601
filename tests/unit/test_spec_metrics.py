"""Speculative decoding's metrics, vLLM's: verify events (num_drafts), drafted and accepted
tokens and accepted tokens by draft position, counted by the engine on a tiny random Llama,
carried by heartbeats (WorkerStats) and exported by render-serve's /metrics under vLLM's
names, with each worker's method in duet_worker_spec_decode_info."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker import Engine
from render_server.generation.metrics import GenerationMetrics
from render_server.http.metrics import RenderMetrics
from render_server.worker_client.pool import WorkerStatus
from shared.protocol import Generate, WorkerStats
from tests.helpers.spec_engines import METHODS, for_target
from tests.unit.test_spec_engine import GREEDY, PENALIZED, PROMPTS

# test_spec_engine's methods (K = 4, fixed draft length: steps draft whatever the drafter
# has, however fast this machine is), repeating prompts and tiny model (the conftest fixture).
K = 4


@pytest.fixture(scope="module", params=sorted(METHODS))
def method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(method: str, tiny_llama_dir: Path) -> Engine:
    return Engine(
        model=str(tiny_llama_dir),
        device="cpu",
        kv_cache_memory_gb=0.01,
        speculative_config=for_target(METHODS[method], tiny_llama_dir),
    )


def _counts(stats: WorkerStats) -> tuple[int, int, int, list[int]]:
    return (
        stats.spec_num_drafts,
        stats.spec_num_draft_tokens,
        stats.spec_num_accepted_tokens,
        stats.spec_accepted_per_position,
    )


def test_each_step_counts_one_draft_and_its_accepted_head_per_position(engine: Engine) -> None:
    """One request: a step with drafts is one verify event whose tokens are its accepted
    drafts plus the target's own, each accepted draft counted at its position."""
    engine.add_request(Generate(request_id="one", prompt_token_ids=PROMPTS[0], sampling=GREEDY))
    before = _counts(engine.stats())
    verify_steps = 0
    while engine.has_unfinished_requests():
        [delta] = engine.step()
        after = _counts(engine.stats())
        drafts, drafted, accepted, per_position = (
            after[0] - before[0],
            after[1] - before[1],
            after[2] - before[2],
            [a - b for a, b in zip(after[3], before[3], strict=True)],
        )
        assert drafts == (1 if drafted else 0)
        assert 0 <= accepted <= drafted <= K
        assert per_position == [1] * accepted + [0] * (K - accepted)
        if delta.finish_reason is None:  # the last step may cut its tokens at max_tokens
            assert len(delta.new_token_ids) == accepted + 1
        verify_steps += drafts
        before = after
    assert verify_steps > 0


def test_batched_counts_are_an_acceptance_length_distribution(method: str, engine: Engine) -> None:
    before = engine.stats()
    # Penalized requests reject some of the drafts the target drafting for itself makes.
    engine.generate(PROMPTS, [GREEDY, GREEDY, PENALIZED, PENALIZED])
    after = engine.stats()
    assert after.spec_method == method
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_position = [
        a - b
        for a, b in zip(
            after.spec_accepted_per_position, before.spec_accepted_per_position, strict=True
        )
    ]
    assert len(per_position) == K
    assert sum(per_position) == accepted > 0
    assert per_position == sorted(per_position, reverse=True)  # never grows with position
    assert per_position[0] <= drafts <= drafted <= K * drafts
    assert per_position[-1] > 0  # some verify accepted all K drafts
    assert accepted < drafted  # and some rejected one


def test_heartbeats_from_older_workers_decode_without_the_new_fields() -> None:
    old = msgspec.msgpack.encode({"num_running": 2, "spec_num_draft_tokens": 9})
    stats = msgspec.msgpack.decode(old, type=WorkerStats)
    assert stats.spec_num_draft_tokens == 9
    assert (stats.spec_method, stats.spec_num_drafts, stats.spec_accepted_per_position) == (
        None,
        0,
        [],
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_export_vllm_names_per_worker_and_each_workers_method() -> None:
    speculating = WorkerStats(
        spec_method="suffix", spec_num_drafts=12, spec_num_draft_tokens=40,
        spec_num_accepted_tokens=25, spec_accepted_per_position=[10, 8, 5, 2],
    )  # fmt: skip
    idle = WorkerStats(spec_method="ngram", spec_accepted_per_position=[0, 0])
    older = WorkerStats(spec_num_draft_tokens=7, spec_num_accepted_tokens=3)
    workers = {"tcp://s:1": speculating, "tcp://i:1": idle, "tcp://o:1": older}
    workers["tcp://plain:1"] = WorkerStats(num_running=1)
    statuses = [
        WorkerStatus(
            address=address, worker_id=None, model_card=None, connected=True, alive=True,
            last_heartbeat=1.0, stats=stats, outstanding=0,
        )
        for address, stats in workers.items()
    ]  # fmt: skip
    host = RenderMetrics()
    GenerationMetrics(host, lambda: statuses, model_name="smol")
    samples = _samples(host.exposition().decode())

    def worker(address: str, **extra: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"model_name": "smol", "worker": address, **extra}.items()))

    s = "tcp://s:1"
    assert samples[("vllm:spec_decode_num_drafts_total", worker(s))] == 12
    assert samples[("vllm:spec_decode_num_draft_tokens_total", worker(s))] == 40
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", worker(s))] == 25
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [samples[(per_pos, worker(s, position=str(j)))] for j in range(4)] == [10, 8, 5, 2]
    assert samples[("vllm:spec_decode_num_drafts_total", worker("tcp://i:1"))] == 0
    assert samples[(per_pos, worker("tcp://i:1", position="1"))] == 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", worker("tcp://o:1"))] == 7

    info = {
        dict(labels)["worker"]: (dict(labels)["method"], value)
        for (name, labels), value in samples.items()
        if name == "duet_worker_spec_decode_info"
    }
    assert info == {s: ("suffix", 1), "tcp://i:1": ("ngram", 1)}
    spec_workers = {
        dict(labels)["worker"]
        for (name, labels), _ in samples.items()
        if name.startswith("vllm:spec_decode_")
    }
    assert spec_workers == {s, "tcp://i:1", "tcp://o:1"}  # never the plain worker
