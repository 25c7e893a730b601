"""The engine's configuration: frozen dataclasses built once at the entry point, passed down.

`EngineConfig` is what `gpu-worker`'s command line and `Engine(...)` take: every field is a
flag (`gpu_worker/cli.py` generates them from this class with `shared.cli_fields`: name,
type, default, and the docstring under the field as its help). At startup the engine
resolves the sizes that depend on the model and the device and hands each component its
own small config: `CacheConfig` to the KV cache manager, `SchedulerConfig` to the
scheduler. A default shared by two of them is written once, on the component's config.

Fields are keyword-only: a required field may follow defaulted ones, and call sites read
like the flags they come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from gpu_worker.spec_decode.config import SpeculativeConfig, parse_speculative_config
from shared.cli_fields import Flag
from shared.model_card import SchedulingPolicy
from shared.model_source import DEFAULT_MODEL

CpuPrecision = Literal["exact", "fast"]
"""--cpu-precision: fp32 throughout, or bf16 matmuls where the CPU has them
(gpu_worker.ops.cpu_precision)."""
CPU_PRECISIONS: tuple[CpuPrecision, ...] = get_args(CpuPrecision)

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The values of --kv-cache-dtype: vLLM's flag, without its fp8 ones (refused by name)."""


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Shape of the paged KV cache and whether full blocks are shared across sequences."""

    block_size: int = 16
    """Tokens per KV block; also the unit of prefix hashing (`shared/hashing.py`)."""
    num_blocks: int
    """Blocks in the pool, sized from free device memory by the worker at startup."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches, so shared prefixes are computed once."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine step and of one sequence."""

    max_num_seqs: int = 256
    """Most sequences running at once (holding KV blocks and scheduled each step)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes plus prefill chunks. Long prompts are chunked to fit."""
    max_model_len: int
    """Longest sequence, prompt plus output; reaching it finishes with reason "length"."""
    long_prefill_token_threshold: int | None = None
    """Cap on one sequence's prefill chunk per step, so one long prompt cannot take the
    whole budget from other prefills; None means only the step budget caps it."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """fcfs: arrival order. priority: lower `priority` first, then arrival order, for both
    admission and the running order; preemption takes the last in that order."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among the running sequences (the runner's slots); None
    when LoRA is off. Base-model sequences do not count."""

    def __post_init__(self) -> None:
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be positive, got {threshold}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Arguments of `Engine(...)` and flags of `gpu-worker`; sizes resolved at startup."""

    model: str = DEFAULT_MODEL
    """Built-in model name, .gguf file or HF model directory."""
    served_model_name: str | None = None
    """Model id reported to clients (default: the model's own name)."""
    device: str = "auto"
    """auto, cuda, cuda:N or cpu."""
    dtype: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    # Defaults the components' configs own are read from them (dataclass class attributes).
    block_size: int = CacheConfig.block_size
    """Tokens per KV cache block."""
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    """Most sequences in one batch."""
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    """Token budget of one step (decodes plus prefill chunks)."""
    long_prefill_token_threshold: int | None = SchedulerConfig.long_prefill_token_threshold
    """Most prompt tokens one request may prefill in one step, so a long prompt cannot take
    the whole step budget from other prefills (default: only the step budget caps it)."""
    max_model_len: int | None = None
    """Longest prompt plus output (default: the model's context length)."""
    scheduling_policy: SchedulingPolicy = SchedulerConfig.scheduling_policy
    """fcfs (arrival order; a request with a non-zero priority is refused) or priority
    (lower values are scheduled first and preempted last; ties in arrival order)."""
    kv_cache_memory_gb: float | None = None
    """KV cache size in GiB (default: 1 on CPU; on CUDA sized by a profiling run of the largest
    prefill and decode steps, within `gpu_memory_utilization`)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type: auto (the model's dtype), float32, bfloat16 or float16.
    A 16-bit cache holds twice the tokens in the same memory and halves the bytes attention
    reads; keys and values are rounded to it when stored. vLLM's fp8 values are refused."""
    gpu_memory_utilization: float = 0.9
    """Share of GPU memory the worker may use in all: weights, KV cache and activations."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, torch on CPU), torch or triton."""
    async_scheduling: bool = False
    """Prepare step N+1 on the host while step N runs on the device: step N's sampled ids
    stay on the device as step N+1's inputs, and the host reads them one step later.
    Outputs are unchanged; a request that ends at step N may compute one more token,
    which is dropped. Steps that need the previous token on the host (structured
    outputs, penalties, bad_words, speculative decoding, tensor parallelism) run in
    order (default: off until measured faster on a GPU; see bench/RESULTS.md)."""
    enforce_eager: bool = False
    """No CUDA graphs: run every decode step eagerly (graphs are used on CUDA only)."""
    cuda_graph_max_batch_size: int | None = None
    """Largest decode batch captured in a CUDA graph (default: min(max-num-seqs, 512))."""
    cpu_gguf_kernels: bool = True
    """On CPU in fp32 from a GGUF file, multiply decode-sized batches (up to
    `gguf_linear.MAX_QUANTIZED_ROWS` rows) on the file's 4-8 bit blocks rather than on
    dense fp32 weights: the same weight values in ~5x fewer bytes per step."""
    cpu_precision: CpuPrecision = "exact"
    """exact: fp32 arithmetic throughout (the default). fast: on a CPU with bf16 dot
    products (AVX512-BF16, AMX), an fp32 model multiplies prefill and batched decode in
    bf16 with fp32 accumulation (greedy outputs may then differ from fp32's); elsewhere
    it runs exact, with a warning."""
    enable_prefix_caching: Annotated[bool, Flag(name="--no-prefix-caching")] = (
        CacheConfig.enable_prefix_caching
    )
    """Share full KV blocks between requests with the same prefix."""
    max_waiting: int = 4096
    """Queued requests beyond this are rejected with `queue_full`."""
    tensor_parallel_size: int = 1
    """Ranks (one process and device each) that split every layer's heads and MLP and the
    KV cache; rank 0 serves the socket, schedules and samples."""
    dist_init_addr: str | None = None
    """HOST:PORT of rank 0's rendezvous, which every rank joins (default: a free loopback
    port, for a single node; required with --nnodes above 1)."""
    nnodes: int = 1
    """Nodes the tensor-parallel ranks span, each starting tensor-parallel-size / nnodes."""
    node_rank: int = 0
    """This node's index; node 0 holds rank 0 and the socket, the others only follow."""
    tp_rank_offset: int | None = None
    """Global rank of this node's first rank (default: node_rank x ranks per node); set it
    to place ranks otherwise. Node 0's must be 0."""
    dist_timeout_s: float = 60.0
    """Seconds a collective or the rendezvous waits for a peer: a dead rank fails the
    others' next step within it."""
    enable_lora: Annotated[bool, Flag(section="LoRA adapters")] = False
    """Serve LoRA adapters of the model: a request names one (the API's `model`), and one
    batch mixes the base model and up to max-loras adapters."""
    max_loras: int = 1
    """Adapters resident at once, in preallocated slots; others registered wait in CPU
    memory and are copied in when a request needs them (least recently used out)."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted: the width of every slot."""
    lora_modules: Annotated[list[str], Flag(metavar="NAME=PATH")] = field(default_factory=list)
    """An adapter registered at start: NAME=PATH of a PEFT directory (the operator's own
    path: no --lora-root check); repeatable."""
    lora_root: Path | None = None
    """The directory runtime loads (render's --lora-modules and POST
    /v1/load_lora_adapter) must resolve inside, symlinks followed; without it they are
    refused."""
    speculative_config: Annotated[str | None, Flag(section="Speculative decoding")] = None
    """vLLM's JSON object, e.g. '{"method": "ngram", "num_speculative_tokens": 4}':
    draft up to K tokens per decode step (ngram: prompt lookup; suffix: suffix decoding;
    draft_model: a small model with the same tokenizer, '"model": PATH') and verify them
    in one forward pass; greedy output is unchanged (default: off)."""

    def __post_init__(self) -> None:
        self._check_lora()
        if self.cpu_precision not in CPU_PRECISIONS:
            raise ValueError(
                f"--cpu-precision {self.cpu_precision}: use one of {', '.join(CPU_PRECISIONS)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: not supported; use one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
                + (" (duet has no fp8 KV cache)" if self.kv_cache_dtype.startswith("fp8") else "")
            )
        self.speculative()  # a malformed or unsupported config fails at start
        size, nnodes = self.tensor_parallel_size, self.nnodes
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {size}")
        if nnodes < 1 or size % nnodes:
            raise ValueError(f"{size} tensor-parallel ranks do not divide over {nnodes} nodes")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank {self.node_rank} is outside {nnodes} nodes")
        offset, per_node = self.tp_rank_offset, size // nnodes
        if offset is not None and not (0 <= offset <= size - per_node):
            raise ValueError(f"tp_rank_offset {offset} leaves this node's ranks outside {size}")
        if offset is not None and (offset == 0) != (self.node_rank == 0):
            raise ValueError(
                "rank 0 is node 0's first rank: tp_rank_offset 0 goes with node_rank 0"
            )
        if nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("several nodes need dist_init_addr, the HOST:PORT of rank 0")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be positive, got {self.dist_timeout_s}")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules or self.lora_root is not None:
                raise ValueError("--lora-modules and --lora-root need --enable-lora")
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}) "
                "must be positive"
            )
        self.lora_module_paths()  # a malformed entry fails at start

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config, None when off; a ValueError names the bad field."""
        if self.speculative_config is None:
            return None
        return parse_speculative_config(self.speculative_config)

    def lora_module_paths(self) -> dict[str, Path]:
        """The --lora-modules as name -> path; a ValueError names a malformed or repeated one."""
        modules: dict[str, Path] = {}
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path or len(name) > 128:
                raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH (NAME <= 128)")
            if name in modules:
                raise ValueError(f"--lora-modules names {name!r} twice")
            modules[name] = Path(path)
        return modules

    def context_limit(self, max_position_embeddings: int) -> int:
        """The longest sequence served: `max_model_len`, else the model's context. A sliding
        window does not bound it: attention masks keys outside each layer's window (the
        cache keeps them all)."""
        return self.max_model_len or max_position_embeddings

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """The config of `Engine(**kwargs)`; an unknown keyword is a TypeError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)
