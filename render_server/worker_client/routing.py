"""Where a request goes: least outstanding work, with prefix-cache affinity.

Pure functions, one small LRU map and the `Router` that holds the policy's state, no
sockets, so the policy is tested in milliseconds (tests/unit/test_routing.py).
`render_server.worker_client.pool` feeds the router each candidate worker's load.

The policy: a request for a LoRA adapter goes to a worker that can serve it, preferring
one that holds it resident in a slot (`adapter_holders`). Among those, a worker whose KV
cache probably holds the longest prefix of the prompt is preferred, because a prefix hit
saves the whole prefill of those tokens; but not when it is busier than the least-loaded
worker by more than `margin`, because queueing behind a hot worker costs more than
recomputing a prefix. `--routing round_robin` swaps it for plain rotation (among the
adapter's holders), so a benchmark can measure what the affinity is worth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from shared.hashing import BlockHash, prefix_block_hashes
from shared.protocol import Generate

AFFINITY_MAX_BLOCKS = 64
"""Only the first blocks of a prompt are hashed: enough to tell shared system prompts and
conversations apart, cheap enough (~64 BLAKE2b calls) to do on every request."""
AFFINITY_CAPACITY = 200_000
"""Entries of the hash -> worker map (~16 MB at most)."""
AFFINITY_MARGIN = 4
"""How much busier than the least-loaded worker the prefix holder may be and still win."""

AdapterPresence = Literal["absent", "registered", "resident"]
"""What a worker has of a request's adapter, from its last heartbeat: nothing, the adapter
registered (loadable into a slot from host memory), or resident in a slot."""

RoutingMode = Literal["prefix", "round_robin"]
"""`prefix`: least load with prefix-cache affinity (`choose_worker`, the default).
`round_robin`: each live worker in turn, blind to load and prefixes; the baseline a
benchmark compares prefix-aware routing against."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One candidate worker as the router sees it."""

    key: str
    """The worker's address; also what the affinity map stores."""
    outstanding: int
    """Requests this render process has in flight on the worker."""
    running: int = 0
    """From the worker's last heartbeat (all render processes together)."""
    waiting: int = 0
    adapter: AdapterPresence = "absent"
    """Of the request's LoRA adapter; "absent" for a base-model request."""

    @property
    def load(self) -> int:
        return self.outstanding + self.running + self.waiting


def choose_worker(
    candidates: Sequence[WorkerLoad],
    *,
    preferred: str | None = None,
    margin: int = AFFINITY_MARGIN,
    rotation: int = 0,
) -> int:
    """Index in `candidates` of the worker to send a request to.

    `preferred` is the worker holding the prompt's longest known prefix; it wins unless
    its load exceeds the least load by more than `margin`. Ties on load go to the worker
    with fewer of our own requests, then rotate by `rotation`, so an idle pool is still
    spread evenly instead of always filling the first worker.
    """
    if not candidates:
        raise ValueError("no candidate workers")
    count = len(candidates)
    best = 0
    best_rank: tuple[int, int, int] | None = None
    for i, worker in enumerate(candidates):
        rank = (worker.load, worker.outstanding, (i - rotation) % count)
        if best_rank is None or rank < best_rank:
            best, best_rank = i, rank
    if preferred is not None:
        least = candidates[best].load
        for i, worker in enumerate(candidates):
            if worker.key == preferred:
                return i if worker.load <= least + margin else best
    return best


def adapter_holders(
    candidates: Sequence[WorkerLoad], *, margin: int = AFFINITY_MARGIN, resident_first: bool = True
) -> list[int]:
    """Indices in `candidates` that a request for a LoRA adapter should choose among.

    Only workers that register the adapter can serve it. Among them the ones holding it
    resident win (no slot fill, no eviction) unless the least loaded of those is busier
    than the least loaded holder by more than `margin`: filling a slot is a copy from host
    memory, cheaper than queueing. `resident_first=False` (round robin) keeps every
    holder. When no candidate registers it (a load still on its way), every candidate:
    the worker answers lora_not_found if it cannot serve it.
    """
    registered = [i for i, worker in enumerate(candidates) if worker.adapter != "absent"]
    if not registered:
        return list(range(len(candidates)))
    resident = [i for i in registered if candidates[i].adapter == "resident"]
    if not resident_first or not resident:
        return registered
    least_resident = min(candidates[i].load for i in resident)
    least_registered = min(candidates[i].load for i in registered)
    return resident if least_resident <= least_registered + margin else registered


def round_robin(count: int, rotation: int) -> int:
    """Index of the worker whose turn it is among `count` candidates."""
    if count < 1:
        raise ValueError("no candidate workers")
    return rotation % count


class PrefixAffinity:
    """Bounded LRU map from prefix block hash to the worker that prefix was last sent to.

    Block hashes chain (each covers its whole prefix), so the deepest hash of a prompt
    found in the map names the worker that saw the longest matching prefix.
    """

    def __init__(self, capacity: int = AFFINITY_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._workers: OrderedDict[BlockHash, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._workers)

    def longest_match(self, hashes: Sequence[BlockHash]) -> tuple[str | None, int]:
        """(worker, number of leading blocks it saw) for the deepest known hash."""
        for depth in range(len(hashes), 0, -1):
            worker = self._workers.get(hashes[depth - 1])
            if worker is not None:
                return worker, depth
        return None, 0

    def record(self, hashes: Sequence[BlockHash], worker: str) -> None:
        """Remember that every prefix in `hashes` now lives on `worker`."""
        workers = self._workers
        for block_hash in hashes:
            workers[block_hash] = worker
            workers.move_to_end(block_hash)
        while len(workers) > self.capacity:
            workers.popitem(last=False)


class Router:
    """One pool's routing state: the prefix-affinity map and the rotation that spreads ties.

    It chooses among the loads of the workers a request may go to (`WorkerLink.load`) and
    answers with an index into them; which workers are candidates is the pool's business.
    """

    def __init__(self, mode: RoutingMode = "prefix") -> None:
        self.mode: RoutingMode = mode
        self._affinity = PrefixAffinity()
        self._rotation = 0

    def choose(self, request: Generate, loads: Sequence[WorkerLoad], block_size: int | None) -> int:
        """Index in `loads` of the worker to send a new request to, remembering where its
        prefix went. `block_size`: the workers' KV block size (None: not known yet, so no
        prefix affinity)."""
        servers = self._servers(request, loads)
        candidates = [loads[i] for i in servers]
        if self.mode == "round_robin":
            hashes: list[BlockHash] = []  # blind to prefixes: no hashing cost, no affinity map
            index = round_robin(len(candidates), self._rotation)
        else:
            hashes = affinity_hashes(request, block_size) if block_size is not None else []
            preferred, _ = self._affinity.longest_match(hashes)
            index = choose_worker(candidates, preferred=preferred, rotation=self._rotation)
        self._rotation += 1
        if hashes:
            self._affinity.record(hashes, candidates[index].key)
        return servers[index]

    def choose_failover(self, request: Generate, loads: Sequence[WorkerLoad]) -> int:
        """Index in `loads` of the worker to resume a request on: the least loaded one that
        can serve it, whatever its prefixes."""
        servers = self._servers(request, loads)
        return servers[choose_worker([loads[i] for i in servers])]

    def _servers(self, request: Generate, loads: Sequence[WorkerLoad]) -> list[int]:
        """Indices in `loads` that `request` may go to: for an adapter, the workers that
        register it (resident ones first, unless round robin)."""
        if request.lora_name is None:
            return list(range(len(loads)))
        return adapter_holders(loads, resident_first=self.mode != "round_robin")


def affinity_hashes(request: Generate, block_size: int) -> list[BlockHash]:
    """The prefix block hashes routing uses for a request (its first blocks only); each
    adapter's prompts hash apart from the base model's, as the workers' caches keep them."""
    return prefix_block_hashes(
        request.prompt_token_ids,
        block_size=block_size,
        cache_salt=request.cache_salt,
        max_blocks=AFFINITY_MAX_BLOCKS,
        lora_name=request.lora_name,
    )


def continuation(request: Generate, output_token_ids: Sequence[int]) -> Generate:
    """The Generate that resumes `request` elsewhere after `output_token_ids` were produced.

    The tokens so far join the prompt and the budgets shrink by as many, so the client's
    stream goes on where it stopped (token for token under greedy sampling; a seeded or
    penalized request continues plausibly, not identically).
    """
    if not output_token_ids:
        return request
    sampling = request.sampling
    done = len(output_token_ids)
    resumed = msgspec.structs.replace(
        sampling,
        max_tokens=max(1, sampling.max_tokens - done),
        min_tokens=max(0, sampling.min_tokens - done),
        # The first worker sent them; the longer prompt would only repeat them.
        prompt_logprobs=None,
    )
    constraint = request.constraint
    if constraint is not None:  # the new worker's matcher first consumes what was generated
        constraint = msgspec.structs.replace(
            constraint, num_resumed_tokens=constraint.num_resumed_tokens + done
        )
    return msgspec.structs.replace(
        request,
        prompt_token_ids=[*request.prompt_token_ids, *output_token_ids],
        sampling=resumed,
        constraint=constraint,
    )
