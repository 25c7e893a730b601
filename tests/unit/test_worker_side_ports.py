"""The worker's side ports in-process: KV events on the wire exactly as vLLM lays them out,
and both ports failing at once when they cannot open."""

from __future__ import annotations

import socket

import msgspec
import pytest
import zmq

from gpu_worker.cli import ServerConfig, open_side_ports
from gpu_worker.core.config import CacheConfig
from gpu_worker.core.kv_cache import KVCacheManager
from gpu_worker.core.sequence import Sequence
from gpu_worker.server.kv_events import KVEventPublisher, binds
from shared.sampling import SamplingParams
from tests.helpers.waiting import wait_until


def test_endpoints_are_bound_or_connected_as_vllm_does() -> None:
    assert binds("tcp://*:5557")
    assert binds("ipc:///tmp/kv-events")
    assert binds("tcp://[::]:5557")
    assert not binds("tcp://indexer.llm-d:5557")
    assert not binds("tcp://127.0.0.1:5557")


def test_a_batch_on_the_wire() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=3, enable_prefix_caching=True))
    publisher = KVEventPublisher("tcp://127.0.0.1:*", topic="kv@w")
    publisher.follow(kv)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@w")
    sub.connect(publisher.endpoint)
    try:

        def subscribed() -> bool:
            kv.reset_prefix_cache()  # an event to publish until one comes through
            publisher.publish_pending()
            return bool(sub.poll(50))

        wait_until(subscribed, 10, "the subscription to reach the publisher", interval_s=0)
        while sub.poll(50):
            _, seq, _ = sub.recv_multipart()
        first_seq = int.from_bytes(seq, "big") + 1

        seq_a = Sequence("a", list(range(10)), SamplingParams(), block_size=4)
        assert kv.allocate_slots(seq_a, 10)
        seq_a.num_computed_tokens = 10
        kv.cache_full_blocks(seq_a)  # blocks 0 and 1 cached
        kv.free(seq_a)
        seq_b = Sequence("b", [7] * 10, SamplingParams(), block_size=4)
        assert kv.allocate_slots(seq_b, 10)  # block 2, then evicts block 1 and block 0
        publisher.publish_pending()

        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@w"
        assert seq == first_seq.to_bytes(8, "big")
        ts, events, rank = msgspec.msgpack.decode(payload)
        hashes = [int.from_bytes(h, "big") & (2**64 - 1) for h in seq_a.block_hashes]
        assert isinstance(ts, float)
        assert rank == 0
        assert events == [
            ["BlockStored", hashes, None, list(range(8)), 4, None, "GPU"],
            ["BlockRemoved", hashes[::-1], "GPU"],
        ]
    finally:
        sub.close(linger=0)
        context.term()
        publisher.close()


def test_a_port_that_cannot_open_fails_at_once() -> None:
    with pytest.raises(zmq.ZMQError):
        open_side_ports(ServerConfig(kv_events_endpoint="nonsense"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="in use"):
            open_side_ports(ServerConfig(metrics_port=taken.getsockname()[1]))
