"""Load a model's config and weights from an HF safetensors directory or a GGUF file.

Both sources are turned into one `ModelConfig`, read by the class of the source's
architecture (each family in `gpu_worker.models` parses its own configs), and a stream of
HF-named tensors, which the model copies into its (fused) parameters. GGUF tensors are
dequantized to fp32 with the `gguf` package, and llama.cpp's Q/K row permutation is undone so
that every model uses HF's rotate_half rotary convention. A tensor-parallel rank reads both
lazily, only its part of each tensor (`gguf_tensors` for GGUF)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from safetensors import safe_open

from gpu_worker.attention.backend import AttentionBackend
from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.distributed.group import TPGroup
from gpu_worker.distributed.parallelize import parallelize
from gpu_worker.gguf_tensors import GGUFTensorSource
from gpu_worker.models import GGUF_ARCHITECTURES, HF_MODEL_TYPES, CausalLM, get_model_class
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_layout import GGUFLayout
from gpu_worker.models.weights import TensorSource
from gpu_worker.ops.gguf_linear import (
    QuantizedWeight,
    gguf_quantized_weights,
    quantized_kernels_available,
)
from gpu_worker.ops.layer_ops import LayerOps
from shared.gguf_metadata import GGUFMetadata, read_gguf_metadata
from shared.model_source import ModelSource


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4.x `rope_scaling` or 5.x
    `rope_parameters`), read by the class of its architecture (`architectures[0]`, else the
    one its `model_type` names)."""
    of_model_type = HF_MODEL_TYPES.get(hf_config.get("model_type", ""), "")
    architecture = (hf_config.get("architectures") or [of_model_type])[0]
    return get_model_class(architecture).config_from_hf(architecture, hf_config)


def config_from_gguf(metadata: GGUFMetadata) -> ModelConfig:
    """ModelConfig from a GGUF file's `{arch}.*` metadata and its tensor table, read by the
    class of its `general.architecture`."""
    architecture = metadata.string("general.architecture")
    model_cls = GGUF_ARCHITECTURES.get(architecture or "")
    if architecture is None or model_cls is None:
        raise NotImplementedError(f"GGUF architecture {architecture!r} is not supported")
    return model_cls.config_from_gguf(architecture, metadata)


def _safetensors_files(model_dir: Path) -> list[str]:
    """`model.safetensors`, or every shard `model.safetensors.index.json` names."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def iter_hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files."""
    for file in _safetensors_files(model_dir):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def iter_hf_slices(model_dir: Path) -> Iterator[tuple[str, TensorSource]]:
    """`iter_hf_weights`, each tensor lazy: indexing it reads only the rows or columns it
    names from the file, so a tensor-parallel rank never holds a whole tensor."""
    for file in _safetensors_files(model_dir):
        with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_slice(name)


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unused."""
    return _gguf_layout(arch).hf_name(name)


def _gguf_layout(arch: str) -> GGUFLayout:
    return get_model_class(arch).gguf_layout(arch)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter `permute`, which is
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`:
    it interleaves each head's two rotary halves into (even, odd) pairs. Reading the rows back
    as (n_head, half, 2) and swapping the last two row axes restores (2, half) = HF's order."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(
    tensor: ReaderTensor, name: str, config: ModelConfig, layout: GGUFLayout
) -> torch.Tensor:
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # gguf lists dimensions innermost first; numpy/torch want them outermost first.
    array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if layout.permuted_qk:
        if ".q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif ".k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
    if layout.is_stored_plus_one(name):
        array = array - 1.0  # a new array
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only mmap
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _qk_row_order(
    name: str, rows: int, config: ModelConfig, layout: GGUFLayout
) -> np.ndarray | None:
    """`unpermute_qk` as row indices (for weights kept in their GGUF blocks); None for
    tensors it leaves alone."""
    if not layout.permuted_qk:
        return None
    if ".q_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_heads)
    if ".k_proj." in name:
        return unpermute_qk(np.arange(rows), config.num_kv_heads)
    return None


def gguf_block_weights(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """HF name -> `QuantizedWeight` for each matrix in a type the CPU kernel reads
    (`gguf_linear.SUPPORTED_TYPES`: Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K), Q/K rows in HF order."""
    layout = _gguf_layout(config.architecture)
    named = [(n, t) for t in reader.tensors if (n := layout.hf_name(t.name)) is not None]
    orders = {}
    for name, tensor in named:
        order = _qk_row_order(name, int(tensor.shape[-1]), config, layout)
        if order is not None:
            orders[name] = order
    return gguf_quantized_weights(named, orders)


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: ModelConfig, num_threads: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized fp32 tensors under HF names, with Q/K rows back in HF's rotary order.

    numpy releases the GIL, so a few tensors are dequantized ahead on worker threads; the
    window is bounded so that at most `num_threads` fp32 tensors wait in memory at once."""
    # Unmapped tensors (rope_freqs, rope_factors_*) are already folded into the config.
    layout = _gguf_layout(config.architecture)
    named = [(t, n) for t in reader.tensors if (n := layout.hf_name(t.name)) is not None]
    window = num_threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(window) as pool:
        pending: deque[tuple[str, Future[torch.Tensor]]] = deque()
        for tensor, name in named:
            pending.append((name, pool.submit(_dequantize, tensor, name, config, layout)))
            if len(pending) >= window:
                done_name, future = pending.popleft()
                yield done_name, future.result()
        while pending:
            done_name, future = pending.popleft()
            yield done_name, future.result()


def iter_gguf_slices(
    reader: gguf.GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, TensorSource]]:
    """`iter_gguf_weights`, each tensor lazy: indexing it dequantizes only the rows (and the
    blocks of columns) it names, Q/K rows read through their HF order, so a
    tensor-parallel rank never dequantizes a whole tensor."""
    layout = _gguf_layout(config.architecture)
    for tensor in reader.tensors:
        name = layout.hf_name(tensor.name)
        if name is None:
            continue
        order = _qk_row_order(name, int(tensor.shape[-1]), config, layout)
        offset = 1.0 if layout.is_stored_plus_one(name) else 0.0
        yield name, GGUFTensorSource(tensor, order, offset)


def load_config(source: ModelSource) -> ModelConfig:
    """The config alone (cheap for HF; a GGUF file's header must still be parsed)."""
    if source.kind == "gguf":
        return config_from_gguf(read_gguf_metadata(source.path))
    return config_from_hf(json.loads((source.path / "config.json").read_text()))


def load_model(
    source: ModelSource,
    device: torch.device,
    dtype: torch.dtype | None = None,
    attn_backend: AttentionBackend | None = None,
    *,
    layer_ops: LayerOps | None = None,
    gguf_kernels: bool = True,
    max_model_len: int | None = None,
    tp_group: TPGroup | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Build the model on `device` in `dtype` (default bf16 on CUDA, fp32 elsewhere) and fill
    it with the source's weights. Attention and layer ops default to plain torch. `gguf_kernels`
    lets an fp32 CPU model read a GGUF file's quantized blocks in decode-sized matmuls.
    `max_model_len`, the context the engine serves, replaces the model's own: the rotary
    tables cover it, and LongRoPE takes its short factors when it fits the original context.

    With a `tp_group` the model is that rank's shard (`gpu_worker.distributed.parallelize`):
    the rank reads only its rows and columns of each tensor, from safetensors or GGUF (a
    GGUF tensor's blocks covering them, dequantized; its Q/K rows found through llama.cpp's
    order). The shard runs on dense weights in `dtype`, not on the file's quantized blocks
    (`gguf_kernels` is for one rank alone). The returned config is the full model's."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sharded = tp_group is not None and tp_group.world_size > 1
    weights: Iterator[tuple[str, TensorSource]]
    if source.kind == "gguf":
        config = config_from_gguf(read_gguf_metadata(source.path))
        reader = gguf.GGUFReader(source.path)  # for the tensors alone
        read = iter_gguf_slices if sharded else iter_gguf_weights
        weights = read(reader, config)
    else:
        config = config_from_hf(json.loads((source.path / "config.json").read_text()))
        weights = iter_hf_slices(source.path) if sharded else iter_hf_weights(source.path)
    if max_model_len is not None:
        config = dataclasses.replace(config, max_position_embeddings=max_model_len)
    model_cls = get_model_class(config.architecture)
    # Build on the meta device: no random init of weights that are overwritten at once.
    with torch.device("meta"):
        model = model_cls(config, attn_backend or TorchAttentionBackend(), layer_ops)
        if tp_group is not None and sharded:
            parallelize(model, tp_group)
    model = model.to(dtype).to_empty(device=device)
    # A rank's shard takes lazy tensors: its shard hook (`load_stacked_weights`) reads them.
    model.load_weights(cast(Iterator[tuple[str, torch.Tensor]], weights))
    model.build_caches(device)
    quantized = gguf_kernels and not sharded
    if source.kind == "gguf" and quantized and quantized_kernels_available(device, dtype):
        # fp32 on CPU: decode reads the file's 4-8 bit blocks instead (gpu_worker.ops.gguf_linear).
        model.attach_quantized(gguf_block_weights(reader, config))
    model.eval().requires_grad_(False)
    return model, config
