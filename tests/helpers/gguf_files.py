"""GGUF files written from a tiny HF model, as llama.cpp's converter would write them.

Every family's converter writes the same header keys from the HF config (layer count,
context, widths, head counts, rope base, RMS epsilon); `gguf_file` writes those and leaves
the family's own keys and the tensors to the caller. A file without key/value lengths
(`head_dims=False`) makes the loader derive the head width from the hidden size.
`add_f32_tensors` writes a model's tensors unquantized under their GGUF names, for the
families whose converter stores them as the HF checkpoint has them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import transformers

from gpu_worker.loader import gguf_to_hf_name


@contextmanager
def gguf_file(
    config: transformers.PretrainedConfig,
    path: Path,
    arch: str,
    *,
    head_dims: bool = True,
    rope_theta: float | None = None,
) -> Iterator[gguf.GGUFWriter]:
    """A writer for `path` with the common header written; the file is written when the
    block ends without an exception. `rope_theta` replaces the config's flat
    `rope_parameters["rope_theta"]` (Gemma 3 keeps one per attention type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        if head_dims:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        if rope_theta is None:
            rope_theta = config.rope_parameters["rope_theta"]
        writer.add_rope_freq_base(rope_theta)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def add_f32_tensors(
    writer: gguf.GGUFWriter,
    model: transformers.PreTrainedModel,
    arch: str,
    *,
    norm_offset: float = 0.0,
) -> None:
    """Each of `model`'s tensors as F32 under llama.cpp's name for `arch` (no output matrix
    when tied), each name checked to map back through our loader. `norm_offset` is added to
    norm weights (llama.cpp stores Gemma's `1 + weight` whole)."""
    config = model.config
    model_arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        assert gguf_to_hf_name(gguf_name, arch) == name
        data = tensor + norm_offset if norm_offset and name.endswith("norm.weight") else tensor
        writer.add_tensor(gguf_name, np.ascontiguousarray(data.numpy(), dtype=np.float32))
