"""The engine with LoRA adapters against transformers + PEFT: mixed batches, more adapters
than slots, prefix-cache isolation per adapter, and the registry's answers (CPU, fp32)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
import torch

from gpu_worker import Engine
from gpu_worker.engine.errors import RequestRejected
from gpu_worker.lora.adapter import LORA_TARGETS
from shared.protocol import Generate
from shared.sampling import SamplingParams
from tests.helpers.lora_adapters import AdapterSpec, add_peft_adapters, write_random_adapter
from tests.helpers.tiny_models import save_tiny_model

if TYPE_CHECKING:  # imported by the helpers where used: the GPU check runs without peft
    from peft import PeftModel

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = {
    "alpha": AdapterSpec(8, 16, ("q_proj", "v_proj"), seed=1),
    "beta": AdapterSpec(16, 8, LORA_TARGETS, use_rslora=True, seed=2),
    "gamma": AdapterSpec(4, 8, ("gate_proj", "down_proj"), seed=3),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@dataclasses.dataclass
class Served:
    """A tiny model's LoRA root, PEFT over the same weights and adapters, and an engine."""

    model_dir: Path
    lora_root: Path
    peft: PeftModel
    engine: Engine


def _modules(root: Path, names: list[str]) -> list[str]:
    return [f"{name}={root / name}" for name in names]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """One slot for three adapters: every switch between them is a load, most an eviction."""
    out = tmp_path_factory.mktemp("lora-engine")
    model_dir, hf = save_tiny_model(out / "model", "llama", tokenizer="words")
    root = out / "loras"
    peft = add_peft_adapters(hf, SPECS, root)
    engine = Engine(
        model=str(model_dir),
        device="cpu",
        kv_cache_memory_gb=0.01,
        enable_lora=True,
        max_loras=1,
        lora_modules=_modules(root, list(SPECS)),
        lora_root=root,
    )
    return Served(model_dir, root, peft, engine)


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


@torch.no_grad()
def _peft_logits(peft: PeftModel, name: str | None, tokens: list[int]) -> torch.Tensor:
    """PEFT's last-position logits under adapter `name` (None: the base model alone)."""
    ids = torch.tensor([tokens])
    if name is None:
        with peft.disable_adapter():
            return peft(input_ids=ids).logits[0, -1].float()
    peft.set_adapter(name)
    return peft(input_ids=ids).logits[0, -1].float()


def _peft_greedy(peft: PeftModel, name: str | None, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_peft_logits(peft, name, tokens).argmax()))
    return tokens[len(prompt) :]


def test_more_adapters_than_slots_all_complete_with_their_own_outputs(tiny: Served) -> None:
    engine, vocab = tiny.engine, tiny.engine.vocab_size
    names: list[str | None] = ["alpha", None, "beta", "gamma", "alpha", None, "gamma", "beta"]
    prompts = [_prompt(i, 6 + i, vocab) for i in range(len(names))]
    before = engine.stats()
    keys = []
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        keys.append(f"mix-{i}")
        engine.add_request(
            Generate(request_id=keys[-1], prompt_token_ids=prompt, sampling=GREEDY, lora_name=name)
        )
    outputs: dict[str, list[int]] = {key: [] for key in keys}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
        running = {seq.lora_name for seq in engine.scheduler.running} - {None}
        assert len(running) <= 1, running  # max_loras: one adapter among the running
    for key, prompt, name in zip(keys, prompts, names, strict=True):
        assert outputs[key] == _peft_greedy(tiny.peft, name, prompt, GREEDY.max_tokens), name
    after = engine.stats()
    # Three adapters through one slot: each came in at least once, and two pushed another out.
    assert after.lora_loads - before.lora_loads >= 3
    assert after.lora_evictions - before.lora_evictions >= 2
    assert after.lora_registered == list(SPECS)
    assert len(after.lora_resident) == 1


def test_an_adapter_waiting_for_a_slot_lets_base_requests_pass(tiny: Served) -> None:
    engine, vocab = tiny.engine, tiny.engine.vocab_size
    long = msgspec.structs.replace(GREEDY, max_tokens=8)
    first = Generate(
        request_id="slot-a",
        prompt_token_ids=_prompt(40, 5, vocab),
        sampling=long,
        lora_name="alpha",
    )
    blocked = Generate(
        request_id="slot-b",
        prompt_token_ids=_prompt(41, 5, vocab),
        sampling=GREEDY,
        lora_name="beta",
    )
    same = Generate(
        request_id="slot-c",
        prompt_token_ids=_prompt(42, 5, vocab),
        sampling=GREEDY,
        lora_name="alpha",
    )
    base = Generate(request_id="slot-d", prompt_token_ids=_prompt(43, 5, vocab), sampling=GREEDY)
    engine.add_request(first)
    engine.step()
    for request in (blocked, same, base):
        engine.add_request(request)
    engine.step()
    running = {seq.request_id for seq in engine.scheduler.running}
    # beta has no slot while alpha runs; alpha's later request waits behind it (so alpha
    # drains and beta gets its turn), the base request needs no slot and runs.
    assert running == {"slot-a", "slot-d"}
    while engine.has_unfinished_requests():
        engine.step()


def test_the_prefix_cache_is_shared_within_an_adapter_only(tiny: Served) -> None:
    engine = tiny.engine
    prompt = _prompt(77, 41, engine.vocab_size)  # two full blocks of 16 and a tail
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def cached(name: str | None) -> int:
        [completion] = engine.generate([prompt], one, lora_names=[name])
        return completion.num_cached_tokens

    assert cached("alpha") == 0
    assert cached("alpha") == 32
    assert cached("beta") == 0
    assert cached(None) == 0
    assert cached("beta") == 32


def test_unknown_adapters_are_refused_and_the_registry_answers_with_statuses(
    tiny: Served,
) -> None:
    engine = tiny.engine
    request = Generate(
        request_id="x", prompt_token_ids=[5, 6], sampling=GREEDY, lora_name="missing"
    )
    with pytest.raises(RequestRejected) as refused:
        engine.add_request(request)
    assert refused.value.code == "lora_not_found"

    assert engine.load_lora("alpha", "alpha").status == 409  # registered at start
    loaded = engine.load_lora("alpha2", "alpha")  # the same directory under a new name
    assert (loaded.ok, loaded.status) == (True, 200)
    assert engine.load_lora("nope", "../model").status == 400
    assert engine.load_lora("nope", "no-such-dir").status == 404
    assert "alpha2" in engine.stats().lora_registered

    engine.add_request(msgspec.structs.replace(request, request_id="busy", lora_name="alpha2"))
    in_use = engine.unload_lora("alpha2")
    assert (in_use.ok, in_use.status) == (False, 409)
    engine.abort(["busy"])
    assert engine.unload_lora("alpha2").ok
    assert engine.unload_lora("alpha2").status == 404
    assert "alpha2" not in engine.stats().lora_registered
    with pytest.raises(RequestRejected):
        engine.add_request(msgspec.structs.replace(request, request_id="gone", lora_name="alpha2"))


def test_a_worker_without_lora_refuses_adapters(tiny: Served) -> None:
    engine = Engine(model=str(tiny.model_dir), device="cpu", kv_cache_memory_gb=0.01)
    assert engine.model_card.max_loras == 0
    with pytest.raises(RequestRejected) as refused:
        engine.add_request(
            Generate(request_id="x", prompt_token_ids=[5], sampling=GREEDY, lora_name="alpha")
        )
    assert refused.value.code == "lora_disabled"
    assert engine.load_lora("alpha", "alpha").status == 400


def test_the_worker_metrics_count_adapter_loads_and_evictions(tiny: Served) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpu_worker.server.metrics_http import WorkerMetrics

    tiny.engine.generate([[5, 6, 7]], GREEDY, lora_names=["alpha"])  # one adapter resident
    metrics = WorkerMetrics("tiny")
    metrics.observe_stats(tiny.engine.stats())
    registry = CollectorRegistry()
    registry.register(metrics)
    lines = generate_latest(registry).decode().splitlines()
    stats = tiny.engine.stats()
    labels = '{engine="0",model_name="tiny"}'
    assert f"duet_lora_loads_total{labels} {float(stats.lora_loads)}" in lines
    assert f"duet_lora_evictions_total{labels} {float(stats.lora_evictions)}" in lines
    assert f"duet_lora_registered{labels} {float(len(SPECS))}" in lines
    assert f"duet_lora_resident{labels} 1.0" in lines


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"lora_modules": ["a=b"]}, "need --enable-lora"),
        ({"enable_lora": True, "lora_modules": ["no-equals"]}, "NAME=PATH"),
        ({"enable_lora": True, "lora_modules": ["a=x", "a=y"]}, "twice"),
        ({"enable_lora": True, "max_loras": 0}, "positive"),
    ],
)
def test_lora_flags_that_do_not_go_together_fail_at_start(
    arguments: dict[str, Any], message: str
) -> None:
    from gpu_worker.core.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**arguments)


def test_a_bad_lora_module_fails_the_start(tiny: Served) -> None:
    with pytest.raises(ValueError, match="--lora-modules broken"):
        Engine(
            model=str(tiny.model_dir),
            device="cpu",
            kv_cache_memory_gb=0.01,
            enable_lora=True,
            lora_modules=[f"broken={tiny.model_dir}"],  # a model, not an adapter
        )


# ---- the built-in model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, hf_reference_model: Any) -> Served:
    """SmolLM2 with adapters of ranks 8 and 16 on different targets, both resident."""
    root = tmp_path_factory.mktemp("smollm2-loras")
    # PEFT injects its layers into the model it wraps: a copy, not the shared reference.
    specs = {name: SPECS[name] for name in ("alpha", "beta")}
    peft = add_peft_adapters(copy.deepcopy(hf_reference_model), specs, root)
    engine = Engine(
        device="cpu",
        kv_cache_memory_gb=0.05,
        # transformers' dequantized fp32 weights on both sides: the GGUF blocks' own
        # rounding is ~1e-4 (test_lora_model says more).
        cpu_gguf_kernels=False,
        enable_lora=True,
        max_loras=2,
        lora_modules=_modules(root, list(specs)),
    )
    return Served(Path(), root, peft, engine)


def test_smollm2_mixed_batch_gives_each_row_its_own_models_output(smollm2: Served) -> None:
    engine, peft = smollm2.engine, smollm2.peft
    names: list[str | None] = [None, "alpha", "beta", "alpha"]
    prompts = [_prompt(100 + i, 7 + i, engine.vocab_size) for i in range(len(names))]
    sampling = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
    completions = engine.generate(prompts, sampling, lora_names=names)
    for prompt, name, completion in zip(prompts, names, completions, strict=True):
        assert completion.token_ids == _peft_greedy(peft, name, prompt, sampling.max_tokens)
        # First step: the top-5 logprobs against PEFT's log-softmax at the same tokens.
        assert completion.logprobs is not None
        first = completion.logprobs[0]
        reference = torch.log_softmax(_peft_logits(peft, name, prompt), dim=-1)
        got = torch.tensor([first.logprob, *first.top_logprobs])
        want = reference[[completion.token_ids[0], *first.top_token_ids]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        if name is not None:  # the adapter moves the logits far past the tolerance
            base = torch.log_softmax(_peft_logits(peft, None, prompt), dim=-1)
            assert (reference - base).abs().max() > 0.05
    stats = engine.stats()
    assert sorted(stats.lora_resident) == ["alpha", "beta"]
    assert stats.lora_evictions == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_serve_each_rows_adapter_as_eager_steps_do(tmp_path: Path) -> None:
    """The built-in model on CUDA: decode steps replayed from graphs, with each row's slot
    staged, give the tokens of eager steps for a batch of base and two adapters' rows."""
    names: list[str | None] = [None, "alpha", "beta", "alpha", None, "beta"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        lora = {"enable_lora": True, "max_loras": 2, "lora_root": tmp_path}
        engine = Engine(device="cuda", enforce_eager=eager, max_num_seqs=16, **lora)
        assert (engine.runner.decode_graphs is None) is eager
        for name in ("alpha", "beta"):
            if eager:  # written once, for the model's shapes
                write_random_adapter(tmp_path / name, engine.model_config, SPECS[name])
            assert engine.load_lora(name, name).ok
        # Rows 0-1 and 4-5 share a prompt: base against an adapter.
        prompts = [_prompt(200 + i // 2 * 2, 12 + i // 2, engine.vocab_size) for i in range(6)]
        outputs[eager] = [c.token_ids for c in engine.generate(prompts, params, lora_names=names)]
        if not eager:
            assert engine.runner.num_graph_steps > 0
        del engine
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]
    eager_out = outputs[True]
    assert eager_out[0] != eager_out[1]
    assert eager_out[4] != eager_out[5]
