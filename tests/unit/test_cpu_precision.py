"""--cpu-precision fast (gpu_worker.ops.cpu_precision): bf16 instruction detection, the
choice between a layer's GGUF blocks and its bf16 copy by rows, the bf16 product's error,
the fallbacks (exact asked, no bf16 instructions, not an fp32 CPU model), and the
engine in fast against transformers in fp32 and in bf16."""

from __future__ import annotations

import copy
import logging
from typing import Any

import gguf
import pytest
import torch
import torch.nn.functional as F

from gpu_worker import Engine
from gpu_worker.core.config import EngineConfig
from gpu_worker.ops import cpu_precision
from gpu_worker.ops.cpu_precision import (
    bf16_copy,
    bf16_instructions,
    fast_linears,
    wants_fast,
)
from gpu_worker.ops.gguf_linear import QuantizedWeight, quantized_kernels_available
from gpu_worker.ops.linear import FAST_MIN_ROWS, Linear, fast_linear
from shared.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def _needs_onednn_bf16() -> None:
    if bf16_copy(torch.ones(16, 16)) is None:
        pytest.skip("oneDNN runs no bf16 matmul on this CPU or torch build")


def test_bf16_instructions_are_read_from_the_cpu_flags() -> None:
    assert bf16_instructions("flags\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert bf16_instructions("processor : 0\nflags : fpu amx_tile amx_bf16 amx_int8\n")
    assert not bf16_instructions("flags\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert not bf16_instructions("no flags line\n")


def test_fast_is_asked_for_and_needs_an_fp32_cpu_model_and_bf16_instructions(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_precision, "bf16_instructions", lambda: True)
    assert wants_fast("fast", CPU, torch.float32)
    assert not wants_fast("exact", CPU, torch.float32)
    assert not wants_fast("fast", CPU, torch.bfloat16)  # already bf16: nothing to speed up
    assert not wants_fast("fast", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="--cpu-precision quick"):
        EngineConfig(cpu_precision="quick")  # type: ignore[arg-type]
    monkeypatch.setattr(cpu_precision, "bf16_instructions", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert not wants_fast("fast", CPU, torch.float32)
    assert "running exact fp32" in caplog.text


def test_the_bf16_product_is_within_bf16_rounding_of_fp32() -> None:
    _needs_onednn_bf16()
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 256), torch.randn(20, 256), torch.randn(96)
    copy = bf16_copy(w)
    assert copy is not None
    got = fast_linear(x, copy, bias)
    # What the bf16 product computes: inputs rounded to bf16, fp32 sums, output to bf16.
    rounded = (x.bfloat16().double() @ w.bfloat16().double().T).bfloat16().float() + bias
    assert torch.allclose(got, rounded, rtol=1e-2, atol=1e-2)
    exact = x.double() @ w.double().T + bias.double()
    scale = exact.abs().max()
    assert 1e-5 < float((got.double() - exact).abs().max() / scale) < 2e-2


def test_a_layer_keeps_its_gguf_blocks_for_a_few_rows_and_goes_bf16_past_them() -> None:
    _needs_onednn_bf16()
    if not quantized_kernels_available(CPU, torch.float32):
        pytest.skip("the GGUF CPU kernels cannot be built here")
    torch.manual_seed(1)
    layer = Linear(64, 32, bias=False)
    blocks = gguf.quants.quantize(layer.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    layer.quantized = QuantizedWeight.from_gguf(
        blocks, int(gguf.GGMLQuantizationType.Q8_0), (32, 64)
    )
    dense = layer.quantized.dequantize()
    with torch.no_grad():
        layer.weight.copy_(dense)
    assert fast_linears(layer) == 1
    assert layer.fast_weight is not None
    for rows in (1, FAST_MIN_ROWS - 1, FAST_MIN_ROWS, 40):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            got = layer(x)
        if rows < FAST_MIN_ROWS:
            assert torch.equal(got, layer.quantized.linear(x))
        else:
            assert torch.equal(got, fast_linear(x, layer.fast_weight))
            assert not torch.equal(got, F.linear(x, dense))  # bf16 rounding shows


def test_only_fp32_cpu_weights_get_a_bf16_copy() -> None:
    assert bf16_copy(torch.ones(4, 4, dtype=torch.bfloat16)) is None
    assert bf16_copy(torch.ones(4, 4, dtype=torch.float16)) is None


QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 24


def _chosen_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of `tokens` after `prompt`, teacher-forced, fp64."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_fast_engine_errs_less_than_transformers_in_bf16(
    monkeypatch: pytest.MonkeyPatch, hf_reference_model: Any, hf_reference_tokenizer: Any
) -> None:
    """fast rounds the matmuls only (attention, norms and residuals stay fp32), so the
    log-probabilities of what it generates stay closer to transformers' fp32 ones than
    transformers' own bf16 model's are, and it generates fp32's greedy tokens until a
    near-tie."""
    _needs_onednn_bf16()
    monkeypatch.setattr(cpu_precision, "bf16_instructions", lambda: True)
    engine = Engine(device="cpu", cpu_precision="fast")
    assert engine.runner.model.logits_head.fast_weight is not None
    hf_bf16 = copy.deepcopy(hf_reference_model).to(torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    for question in QUESTIONS:
        rendered = hf_reference_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        [ours] = engine.generate([prompt], params)
        assert ours.logprobs is not None
        fast = torch.tensor([entry.logprob for entry in ours.logprobs], dtype=torch.float64)
        exact = _chosen_logprobs(hf_reference_model, prompt, ours.token_ids)
        bf16 = _chosen_logprobs(hf_bf16, prompt, ours.token_ids)
        ours_error = float((fast - exact).abs().max())
        bf16_error = float((bf16 - exact).abs().max())
        assert 0 < ours_error < bf16_error, (question, ours_error, bf16_error)
        # fp32's greedy tokens, up to its first top-2 margin under 0.5 nats.
        with torch.inference_mode():
            out = hf_reference_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
        reference = out.sequences[0, len(prompt) :].tolist()
        margins = [float(s[0].log_softmax(-1).topk(2).values.diff().abs()) for s in out.scores]
        clear = next((i for i, m in enumerate(margins) if m < 0.5), len(margins))
        assert ours.token_ids[:clear] == reference[:clear]
