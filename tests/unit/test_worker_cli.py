"""gpu-worker's flags reach EngineConfig unchanged; an exposed bind without CURVE warns."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gpu_worker.cli import ServerConfig, build_parser, check_exposure, config_from_args
from gpu_worker.core.config import EngineConfig
from shared.transport import is_local_bind


def test_defaults_equal_the_engine_defaults() -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert config == EngineConfig(model=config.model)


def test_every_engine_flag_is_carried() -> None:
    args = build_parser().parse_args(
        [
            "--model", "m.gguf",
            "--device", "cuda:1",
            "--dtype", "float16",
            "--block-size", "32",
            "--max-num-seqs", "64",
            "--max-num-batched-tokens", "4096",
            "--max-model-len", "1024",
            "--kv-cache-memory-gb", "2.5",
            "--gpu-memory-utilization", "0.8",
            "--attention-backend", "triton",
            "--enforce-eager",
            "--cuda-graph-max-batch-size", "48",
            "--no-prefix-caching",
            "--no-cpu-gguf-kernels",
            "--max-waiting", "10",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.model == "m.gguf"
    assert config.device == "cuda:1"
    assert config.dtype == "float16"
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (32, 64, 4096)
    assert config.max_model_len == 1024
    assert config.kv_cache_memory_gb == 2.5
    assert config.gpu_memory_utilization == 0.8
    assert config.attention_backend == "triton"
    assert config.enforce_eager is True
    assert config.cuda_graph_max_batch_size == 48
    assert config.enable_prefix_caching is False
    assert config.max_waiting == 10
    assert config.cpu_gguf_kernels is False


def test_long_prefill_token_threshold_is_a_flag() -> None:
    assert config_from_args(build_parser().parse_args([])).long_prefill_token_threshold is None
    args = build_parser().parse_args(["--long-prefill-token-threshold", "512"])
    assert config_from_args(args).long_prefill_token_threshold == 512


def test_server_flags_keep_their_defaults() -> None:
    from gpu_worker.cli import DEFAULT_BIND, ServerConfig, server_config_from_args

    assert server_config_from_args(build_parser().parse_args([])) == ServerConfig()
    args = build_parser().parse_args(["--heartbeat-interval", "0.5", "--client-timeout", "3"])
    config = server_config_from_args(args)
    assert (config.bind, config.heartbeat_interval_s, config.client_timeout_s) == (
        DEFAULT_BIND, 0.5, 3.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("bind", "local"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://127.3.2.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/worker.sock", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://worker.example.com:5555", False),
    ],
)
def test_is_local_bind(bind: str, local: bool) -> None:
    assert is_local_bind(bind) is local


def test_an_exposed_bind_without_curve_warns(caplog: pytest.LogCaptureFixture) -> None:
    check_exposure(ServerConfig(bind="tcp://0.0.0.0:5555"))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "tcp://0.0.0.0:5555" in record.getMessage()
    assert "--zmq-curve-dir" in record.getMessage()
    caplog.clear()
    check_exposure(ServerConfig(bind="tcp://0.0.0.0:5555", zmq_curve_dir=Path("keys")))
    check_exposure(ServerConfig(bind="tcp://127.0.0.1:5555"))
    assert not caplog.records
