"""LoRA adapters as the render tier knows them: the `--lora-modules` it declares, and the
load and unload operations it runs on its workers.

An adapter's weights never pass through the render tier: a `LoadLoRA` names a path on the
worker's own disk (inside the worker's `--lora-root`), and the worker answers each
operation with one `LoRAResult`. `LoRAOperations` keeps the adapters every worker should
hold, sends the operations and matches the answers; the pool
(render_server.worker_client.pool) feeds it its workers' welcomes, results and losses, all
on the pool's event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.model_card import ModelCard
from shared.protocol import LoadLoRA, LoRAResult, UnloadLoRA

if TYPE_CHECKING:
    from render_server.worker_client.link import WorkerLink

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter the render server declares (`--lora-modules`): every worker that
    connects is asked to load it."""

    name: str
    """What clients pass as `model` to select it."""
    path: str
    """Its directory on the workers' disks (inside their --lora-root)."""
    base_model_name: str | None = None
    """vLLM's field; the adapter's parent in /v1/models is always the served model."""


class _LoRAModuleJson(BaseModel):
    """The JSON form of one --lora-modules value, as vLLM reads it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` value in either of vLLM's forms: `name=path`, or the JSON
    object `{"name": ..., "path": ..., "base_model_name": ...}`; else a ValueError."""
    text = text.strip()
    if "=" in text and not text.startswith("{"):
        name, _, path = text.partition("=")
        module = _LoRAModuleJson(name=name.strip(), path=path.strip())
    else:
        try:
            module = _LoRAModuleJson.model_validate(json.loads(text))
        except json.JSONDecodeError:
            raise ValueError(f"invalid JSON format for --lora-modules: {text!r}") from None
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"invalid fields for --lora-modules {text!r}: {problems}") from None
    return LoRAModule(module.name, module.path, module.base_model_name)


@dataclass(frozen=True, slots=True)
class LoRAOutcome:
    """One worker's answer to a load or unload (or why none came)."""

    address: str
    ok: bool
    status: int
    """The worker's: 200 done, 400 refused, 404 not found, 409 already loaded or in use;
    503 when the worker was lost, 504 when it did not answer in time."""
    message: str


@dataclass
class _PendingOp:
    """A LoadLoRA or UnloadLoRA sent to one worker, until its LoRAResult arrives."""

    link: WorkerLink
    lora_name: str
    action: str
    """"load" or "unload", for the log."""
    answer: asyncio.Future[LoRAOutcome] | None
    """Who waits for it; None for the loads a welcome triggers, which are only logged."""


class LoRAOperations:
    """The adapters every worker should hold, by name, with the operations in flight.

    Those adapters are the render server's --lora-modules, then every runtime load until its
    unload; each worker that welcomes us is asked to load them. A load or unload that
    succeeded on a worker is recorded on its link (`WorkerLink.record_adapter_change`), so
    routing and /v1/models see it before the worker's heartbeats do.
    """

    def __init__(self, modules: Sequence[LoRAModule]) -> None:
        self.paths: dict[str, str] = {module.name: module.path for module in modules}
        self._pending: dict[str, _PendingOp] = {}

    def adapters(self, links: Sequence[WorkerLink]) -> dict[str, str | None]:
        """Every adapter a request may name, with its path where it is known: the ones
        every worker should hold, and any a connected worker registers."""
        adapters: dict[str, str | None] = dict(self.paths)
        for link in links:
            if link.welcomed and link.stats is not None:
                for name in link.stats.lora_registered:
                    adapters.setdefault(name, None)
        return adapters

    async def load(
        self, links: Sequence[WorkerLink], name: str, path: str, timeout_s: float
    ) -> list[LoRAOutcome]:
        """Load adapter `name` from `path` on every link in `links`, all or nothing: when
        any fails (or does not answer within `timeout_s`), the ones that loaded it unload it
        again, and the outcomes say why. On success later workers load it too."""
        outcomes = await self._run(
            links,
            lambda op_id: LoadLoRA(op_id=op_id, lora_name=name, lora_path=path),
            name,
            "load",
            timeout_s,
        )
        if outcomes and all(outcome.ok for outcome in outcomes):
            self.paths[name] = path
            return outcomes
        loaded = {outcome.address for outcome in outcomes if outcome.ok}
        if loaded:
            logger.warning(
                "adapter %r did not load on every worker: unloading it from %s",
                name,
                ", ".join(sorted(loaded)),
            )
            await self._run(
                [link for link in links if link.address in loaded],
                lambda op_id: UnloadLoRA(op_id=op_id, lora_name=name),
                name,
                "unload",
                timeout_s,
            )
        return outcomes

    async def unload(
        self, links: Sequence[WorkerLink], name: str, timeout_s: float
    ) -> list[LoRAOutcome]:
        """Unload adapter `name` from every link in `links`. Once each has unloaded it or
        never had it (404), workers that connect later no longer load it."""
        outcomes = await self._run(
            links, lambda op_id: UnloadLoRA(op_id=op_id, lora_name=name), name, "unload", timeout_s
        )
        if all(outcome.ok or outcome.status == 404 for outcome in outcomes):
            self.paths.pop(name, None)
        return outcomes

    async def _run(
        self,
        links: Sequence[WorkerLink],
        make: Callable[[str], LoadLoRA | UnloadLoRA],
        name: str,
        action: str,
        timeout_s: float,
    ) -> list[LoRAOutcome]:
        """Send `make(op_id)` to each link and wait for their answers; a worker silent past
        `timeout_s` counts as a 504."""
        loop = asyncio.get_running_loop()
        sent: list[tuple[WorkerLink, str, asyncio.Future[LoRAOutcome]]] = []
        for link in links:
            op_id = uuid.uuid4().hex
            answer: asyncio.Future[LoRAOutcome] = loop.create_future()
            self._pending[op_id] = _PendingOp(link, name, action, answer)
            sent.append((link, op_id, answer))
            link.send(make(op_id))
        if sent:
            await asyncio.wait([answer for _, _, answer in sent], timeout=timeout_s)
        outcomes = []
        for link, op_id, answer in sent:
            self._pending.pop(op_id, None)
            if answer.done():
                outcomes.append(answer.result())
            else:
                answer.cancel()
                message = f"worker {link.address} did not answer within {timeout_s:g}s"
                outcomes.append(LoRAOutcome(link.address, False, 504, message))
        return outcomes

    def on_result(self, link: WorkerLink, result: LoRAResult) -> None:
        pending = self._pending.pop(result.op_id, None)
        if pending is None or pending.link is not link:
            return  # answered after its deadline, or forged
        if result.ok:
            link.record_adapter_change(pending.lora_name, pending.action == "load")
        outcome = LoRAOutcome(link.address, result.ok, result.status, result.message)
        if pending.answer is not None:
            if not pending.answer.done():
                pending.answer.set_result(outcome)
        elif result.ok:
            logger.info("worker %s loaded adapter %r", link.address, pending.lora_name)
        elif result.status != 409:  # 409: it holds that name already (its own flags)
            logger.error(
                "worker %s could not load adapter %r from %r (%d): %s",
                link.address,
                pending.lora_name,
                self.paths.get(pending.lora_name),
                result.status,
                result.message,
            )

    def on_welcome(self, link: WorkerLink, card: ModelCard) -> None:
        """Ask a worker that just welcomed us to load every adapter workers should hold."""
        if not self.paths:
            return
        if card.max_loras == 0:
            logger.error(
                "worker %s runs without --enable-lora: adapters %s cannot be served there",
                link.address,
                ", ".join(sorted(self.paths)),
            )
            return
        for name, path in self.paths.items():
            op_id = uuid.uuid4().hex
            self._pending[op_id] = _PendingOp(link, name, "load", None)
            link.send(LoadLoRA(op_id=op_id, lora_name=name, lora_path=path))

    def on_lost(self, link: WorkerLink, message: str) -> None:
        """The worker stopped answering: its operations end as 503s."""
        for op_id, pending in list(self._pending.items()):
            if pending.link is link:
                del self._pending[op_id]
                if pending.answer is not None and not pending.answer.done():
                    pending.answer.set_result(LoRAOutcome(link.address, False, 503, message))
