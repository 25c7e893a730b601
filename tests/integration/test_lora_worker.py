"""A real gpu-worker process with LoRA on (a tiny Llama, one slot): runtime loads inside
--lora-root only, every refusal answered with its status while the worker keeps serving,
the heartbeat's adapter lists, and requests for unknown adapters refused."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from shared.protocol import (
    Generate,
    Heartbeat,
    Hello,
    LoadLoRA,
    LoRAResult,
    Rejected,
    UnloadLoRA,
    Welcome,
)
from shared.sampling import SamplingParams
from tests.helpers.lora_adapters import AdapterSpec, add_peft_adapters
from tests.helpers.processes import SMALL_WORKER, start_worker, stop_worker
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.waiting import wait_until
from tests.integration.test_worker_server import Client

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 17, 42, 9, 33, 8]
_op_ids = itertools.count()


@dataclass
class LoRAWorker:
    client: Client
    welcome: Welcome
    root: Path
    peft: PeftModel


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAWorker]:
    out = tmp_path_factory.mktemp("lora-worker")
    model_dir, hf = save_tiny_model(out / "model", "llama", tokenizer="words")
    root = out / "root"
    specs = {
        "alpha": AdapterSpec(8, 16, ("q_proj", "v_proj"), seed=1),
        "beta": AdapterSpec(16, 8, ("gate_proj", "up_proj", "down_proj", "o_proj"), seed=2),
    }
    peft = add_peft_adapters(hf, specs, root)
    # A valid adapter outside the root, and a symlink inside the root that points at it.
    shutil.copytree(root / "beta", out / "outside")
    (root / "escape").symlink_to(out / "outside")
    args = [
        "--model", str(model_dir), "--enable-lora", "--max-loras", "1",
        "--lora-root", str(root), "--lora-modules", f"alpha={root / 'alpha'}",
    ]  # fmt: skip
    process = start_worker(None, args, **SMALL_WORKER)
    client = Client(process.address)
    try:
        client.send(Hello(client_id="lora-test"))
        welcome = client.recv_until(Welcome)
        assert isinstance(welcome, Welcome)
        yield LoRAWorker(client, welcome, root, peft)
    finally:
        client.close()
        assert stop_worker(process, timeout_s=30) == 0


def _lora_op(worker: LoRAWorker, message: LoadLoRA | UnloadLoRA) -> LoRAResult:
    worker.client.send(message)

    def answered() -> LoRAResult | None:
        reply = worker.client.poll(0.1)
        if isinstance(reply, LoRAResult) and reply.op_id == message.op_id:
            return reply
        return None

    result: LoRAResult = wait_until(answered, 30.0, "the LoRA result", interval_s=0)
    return result


def _load(worker: LoRAWorker, name: str, path: str) -> LoRAResult:
    return _lora_op(worker, LoadLoRA(op_id=f"op-{next(_op_ids)}", lora_name=name, lora_path=path))


def _generate(worker: LoRAWorker, request_id: str, lora_name: str | None) -> list[int]:
    worker.client.send(
        Generate(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=GREEDY, lora_name=lora_name
        )
    )
    return [t for d in worker.client.collect(request_id) for t in d.new_token_ids]


@torch.no_grad()
def _peft_greedy(peft: PeftModel, name: str, steps: int) -> list[int]:
    peft.set_adapter(name)
    tokens = list(PROMPT)
    for _ in range(steps):
        tokens.append(int(peft(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT) :]


def test_the_card_says_lora_is_on(worker: LoRAWorker) -> None:
    card = worker.welcome.model_card
    assert (card.max_loras, card.max_lora_rank) == (1, 16)


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("../outside", 400, "outside the LoRA root"),
        ("escape", 400, "outside the LoRA root"),
        ("https://example.com/adapter", 400, "URL"),
        ("no-such-adapter", 404, "no adapter directory"),
    ],
)
def test_loads_outside_the_root_or_of_nothing_are_refused(
    worker: LoRAWorker, path: str, status: int, says: str
) -> None:
    result = _load(worker, "refused", path)
    assert (result.ok, result.status) == (False, status)
    assert says in result.message


def test_a_load_inside_the_root_serves_the_adapter(worker: LoRAWorker) -> None:
    loaded = _load(worker, "beta", "beta")
    assert (loaded.ok, loaded.status) == (True, 200), loaded.message
    assert _load(worker, "beta", "beta").status == 409
    assert _generate(worker, "with-beta", "beta") == _peft_greedy(worker.peft, "beta", 4)
    assert _generate(worker, "with-alpha", "alpha") == _peft_greedy(worker.peft, "alpha", 4)

    def heartbeat_lists_both() -> Heartbeat | None:
        reply = worker.client.poll(0.1)
        if isinstance(reply, Heartbeat) and reply.stats.lora_loads >= 2:
            return reply
        return None

    beat: Heartbeat = wait_until(heartbeat_lists_both, 10.0, "a heartbeat", interval_s=0)
    assert sorted(beat.stats.lora_registered) == ["alpha", "beta"]
    assert beat.stats.lora_resident == ["alpha"]  # one slot: alpha pushed beta out
    assert beat.stats.lora_evictions >= 1


def test_unknown_adapters_are_refused_and_the_worker_still_serves(worker: LoRAWorker) -> None:
    worker.client.send(
        Generate(request_id="ghost", prompt_token_ids=PROMPT, sampling=GREEDY, lora_name="ghost")
    )
    rejected = worker.client.recv_until(Rejected)
    assert isinstance(rejected, Rejected)
    assert (rejected.request_id, rejected.code) == ("ghost", "lora_not_found")
    unload = _lora_op(worker, UnloadLoRA(op_id="unload-ghost", lora_name="ghost"))
    assert (unload.ok, unload.status) == (False, 404)
    assert len(_generate(worker, "base-after", None)) == GREEDY.max_tokens
