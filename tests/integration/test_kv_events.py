"""A real gpu-worker with `--kv-events-endpoint` and `--metrics-port`, as llm-d's indexer
and a Prometheus scraper see it.

A subscriber binds a SUB socket (as llm-d's indexer does; the worker connects), decodes
each message as plain msgpack (not through duet's structs, so the wire format itself is
checked) and rebuilds the worker's set of cached blocks from the events. Before each
request of a workload that shares, evicts and re-reads prefixes, the rebuilt set predicts
how many prompt tokens the worker will find cached; the worker's own answer
(`num_cached_tokens`) must agree every time. The worker's /metrics (vLLM's names) must
count the same requests and tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from shared.hashing import prefix_block_hashes
from shared.protocol import Abort, Deltas, Generate, Hello, Welcome
from shared.sampling import SamplingParams
from tests.helpers.processes import free_port, start_worker, stop_worker
from tests.helpers.waiting import wait_until
from tests.integration.test_worker_server import Client

BLOCK_SIZE = 8
TOPIC = "kv@test"
MODEL = "SmolLM2-135M-Instruct"
QUIET_S = 0.1
"""A step's events are published before its deltas are sent: this long without a message
after a reply means the subscriber has every event up to that reply."""


def external(block_hash: bytes) -> int:
    """vLLM's integer form of a block hash: the low 64 bits (see kv_events.py)."""
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


class Subscriber:
    """A SUB socket and the cached-block set its events describe."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.next_seq = 0
        self.cached: set[int] = set()
        self.kinds: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def drain(self) -> None:
        """Apply every message until none has come for QUIET_S."""
        while self.socket.poll(int(QUIET_S * 1000)):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            assert int.from_bytes(seq, "big") == self.next_seq, "a gap in the sequence numbers"
            assert len(seq) == 8
            self.next_seq += 1
            self.apply(msgspec.msgpack.decode(payload))

    def apply(self, batch: list) -> None:
        ts, events, data_parallel_rank = batch
        assert isinstance(ts, float)
        assert data_parallel_rank == 0
        for event in events:
            kind = event[0]
            self.kinds[kind] += 1
            if kind == "BlockStored":
                _, hashes, parent, token_ids, block_size, lora_id, medium = event
                assert (block_size, lora_id, medium) == (BLOCK_SIZE, None, "GPU")
                assert len(token_ids) == len(hashes) * BLOCK_SIZE
                assert parent is None or parent in self.cached
                self.cached.update(hashes)
            elif kind == "BlockRemoved":
                _, hashes, medium = event
                assert set(hashes) <= self.cached
                self.cached.difference_update(hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.cached.clear()

    def predicted_cached_tokens(self, prompt: list[int]) -> int:
        """What the worker's lookup finds, if this set is the worker's: the leading blocks
        present, never the block holding the last prompt token."""
        hits = 0
        max_blocks = (len(prompt) - 1) // BLOCK_SIZE
        for block_hash in prefix_block_hashes(prompt, BLOCK_SIZE, max_blocks=max_blocks):
            if external(block_hash) not in self.cached:
                break
            hits += 1
        return hits * BLOCK_SIZE

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    yield sub
    sub.close()


@pytest.fixture(scope="module")
def worker(subscriber: Subscriber) -> Iterator[tuple[str, int]]:
    metrics_port = free_port()
    args = [
        "--kv-events-endpoint", subscriber.endpoint, "--kv-events-topic", TOPIC,
        "--metrics-port", str(metrics_port), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "64",
    ]  # fmt: skip
    # Room for about 90 tokens: the workload below has to evict.
    process = start_worker(None, args, kv_cache_gb=0.004, max_num_seqs=4)
    yield process.address, metrics_port
    assert stop_worker(process, timeout_s=30) == 0


def _workload() -> list[list[int]]:
    """Prompts over four shared prefixes, some long enough to evict the others."""
    rng = random.Random(14)
    stems = [[rng.randrange(100, 40000) for _ in range(24)] for _ in range(3)]
    prompts = []
    for _ in range(10):
        stem = rng.choice(stems)[: rng.choice([10, 17, 24])]
        tail = [rng.randrange(100, 40000) for _ in range(rng.choice([2, 9, 30]))]
        prompts.append(stem + tail)
    return prompts


def _scrape(metrics_port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_events_rebuild_the_workers_cached_blocks(
    worker: tuple[str, int], subscriber: Subscriber
) -> None:
    address, metrics_port = worker
    client = Client(address)
    try:
        client.send(Hello(client_id="kv-events-test"))
        client.recv_until(Welcome)
        total_prompt = total_generated = total_hits = 0
        some_hit = some_partial = False
        for number, prompt in enumerate(_workload()):
            subscriber.drain()
            predicted = subscriber.predicted_cached_tokens(prompt)
            request_id = f"r{number}"
            client.send(
                Generate(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                )
            )
            deltas = client.collect(request_id)
            actual = max(d.num_cached_tokens for d in deltas)
            assert actual == predicted, f"request {number}: worker {actual}, events {predicted}"
            total_prompt += len(prompt)
            total_generated += sum(len(d.new_token_ids) for d in deltas)
            total_hits += actual
            some_hit |= actual > 0
            some_partial |= 0 < actual < (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        subscriber.drain()
        assert some_hit, "the workload should share prefixes"
        assert some_partial, "the workload should lose some prefix blocks"
        assert subscriber.kinds["BlockStored"]
        assert subscriber.kinds["BlockRemoved"]

        # An aborted request counts as vLLM counts it.
        client.send(
            Generate(
                request_id="long",
                prompt_token_ids=[5] * 20,
                sampling=SamplingParams(max_tokens=40, ignore_eos=True),
            )
        )

        def generating() -> bool:
            message = client.poll(0.1)
            return isinstance(message, Deltas) and any(
                d.request_id == "long" and d.new_token_ids for d in message.deltas
            )

        wait_until(generating, 30, "the long request's first token", interval_s=0)
        client.send(Abort(request_ids=["long"]))
    finally:
        client.close()

    labels = (("engine", "0"), ("model_name", MODEL))
    abort = (("engine", "0"), ("finished_reason", "abort"), ("model_name", MODEL))
    length = (("engine", "0"), ("finished_reason", "length"), ("model_name", MODEL))

    def settled() -> dict | None:
        samples = _scrape(metrics_port)
        idle = samples[("vllm:num_requests_running", labels)] == 0
        aborted = samples[("vllm:request_success_total", abort)] == 1
        return samples if idle and aborted else None

    samples = wait_until(settled, 30, "the worker's metrics to show the abort, idle")
    assert samples[("vllm:num_requests_waiting", labels)] == 0
    assert samples[("vllm:kv_cache_usage_perc", labels)] == 0.0  # cached blocks count as free
    assert samples[("vllm:prompt_tokens_total", labels)] == total_prompt + 20
    assert samples[("vllm:generation_tokens_total", labels)] >= total_generated + 1
    assert samples[("vllm:request_success_total", length)] == len(_workload())
    assert samples[("vllm:prefix_cache_queries_total", labels)] == total_prompt + 20
    assert samples[("vllm:prefix_cache_hits_total", labels)] == total_hits
