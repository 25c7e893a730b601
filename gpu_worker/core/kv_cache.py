"""Paged KV cache bookkeeping: a pool of ref-counted blocks, block tables, prefix caching.

Only ids and counts live here; the tensors belong to the model runner. Prefix caching
maps the chained hash of a FULL, COMPUTED block to the block holding its KV, so a new
sequence with the same prefix (and salt) takes those blocks instead of recomputing them.

Free-list order is part of the contract (tests assert exact block ids):
- The free list starts as blocks 0, 1, ..., num_blocks - 1 and new blocks come from its front.
- A freed block with a hash goes to the back: cached blocks are evicted oldest-freed first.
- A freed block without a hash goes to the front: it caches nothing, so reuse it before
  evicting anything useful.
- A sequence's blocks are freed last-to-first, so its tail blocks (least likely to be
  shared) are evicted before its prefix blocks.

Once `record_events()` is called, every change to the set of cached hashes is also kept
as an event (stored, removed, all cleared), in order, for the server to publish
(`gpu_worker.server.kv_events`) the way vLLM does; until then nothing is recorded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from gpu_worker.core.config import CacheConfig
from gpu_worker.core.sequence import Sequence
from shared.hashing import BlockHash


@dataclass(eq=False)
class Block:
    """One KV block: how many sequences use it, and the prefix hash it is cached under."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one sequence newly cached under their hashes."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    """The hash of the block before the first one; None when it is the sequence's first."""
    token_ids: list[int]
    """Every token of those blocks, block after block."""


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted: their hashes no longer find them."""

    block_hashes: list[BlockHash]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache forgot every hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start, counted in tokens as vLLM does."""

    queries: int = 0
    """Tokens of sequences looked up on admission (fresh or after preemption)."""
    hits: int = 0
    """Of those, tokens found in the cache."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """All blocks, the free list (an LRU of evictable cached blocks) and hash -> block."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block with ref_count 0, front = next to be handed out.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.events: list[KVCacheEvent] | None = None
        """Changes to the cached hashes since the server last took them; None (and no
        cost beyond a check) while nobody listens."""

    @property
    def cached_hashes(self) -> set[BlockHash]:
        """Every hash a lookup would find now (what KV events describe)."""
        return set(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_block_ids(self) -> list[int]:
        """The free list in hand-out order (for tests and debugging)."""
        return list(self._free)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def get_new_block(self) -> Block:
        """Take the front free block, evicting its cached hash if it has one."""
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self._removed(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Share a cached block: take it off the free list if nobody was using it."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def free_block(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} freed twice"
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash, unless that hash is taken;
        True if it was registered.

        Two sequences that computed the same prefix in the same step both end up here;
        the first block keeps the hash and the duplicate stays unhashed (freed first).
        """
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget every hash; blocks in use keep their KV but can no longer be shared."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def _removed(self, block_hash: BlockHash) -> None:
        assert self.events is not None
        # Evictions come in runs (one per new block a step takes): one event per run.
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))


class KVCacheManager:
    """Allocates blocks to sequences and shares full prefix blocks between them."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.config = cache_config
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_blocks)
        self.stats = PrefixCacheStats()
        # request_id -> how many leading blocks of its table are already registered.
        self._num_hashed_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate

    def record_events(self) -> None:
        """Keep every change to the cached hashes from now on, for `take_events`."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first (none unless recording)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest run of cached leading blocks of `seq`: (block ids, tokens they cover).

        At most (num_tokens - 1) tokens: the last token is always recomputed, since its
        forward pass gives the logits for the next one. Read-only; `allocate_slots` takes them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: Seq[int] = ()
    ) -> bool:
        """Give `seq` blocks for `cached_blocks` plus `num_new_tokens` more tokens.

        `cached_blocks` (from `get_computed_blocks`, for a sequence holding no blocks yet)
        come first in its table. Returns False and changes nothing when the free list is
        too short; the caller then preempts someone or waits.
        """
        cached = [self.pool.blocks[i] for i in cached_blocks]
        num_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached)
        # Reviving a cached block with ref_count 0 takes it off the free list too.
        num_revived = sum(1 for block in cached if block.ref_count == 0)
        if max(num_needed, 0) + num_revived > self.pool.num_free_blocks:
            return False

        if self.enable_prefix_caching and not seq.block_table:
            # A sequence with no blocks is being admitted: that is one prefix lookup.
            self.stats.queries += seq.num_tokens
            self.stats.hits += len(cached) * self.block_size
            self._num_hashed_blocks[seq.request_id] = len(cached)
        for block in cached:
            self.pool.touch(block)
            seq.block_table.append(block.block_id)
        for _ in range(num_needed):
            seq.block_table.append(self.pool.get_new_block().block_id)
        return True

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the blocks the first `num_tokens` tokens (default: its computed ones)
        have filled since the last call.

        Called after a step with the tokens it ended at, so a hash only ever points at KV
        that has been written (`num_computed_tokens` may already count a step scheduled
        after it).
        """
        if not self.enable_prefix_caching:
            return
        if num_tokens is None:
            num_tokens = seq.num_computed_tokens
        num_full = num_tokens // self.block_size
        start = self._num_hashed_blocks.get(seq.request_id, 0)
        events = self.pool.events
        run: BlockStored | None = None
        for i in range(start, num_full):
            block_hash = seq.block_hashes[i]
            if not self.pool.cache_block(self.pool.blocks[seq.block_table[i]], block_hash):
                run = None  # a duplicate: the blocks after it chain from its hash
                continue
            if events is None:
                continue
            tokens = seq.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            if run is None:
                parent = seq.block_hashes[i - 1] if i > 0 else None
                run = BlockStored([block_hash], parent, tokens)
                events.append(run)
            else:
                run.block_hashes.append(block_hash)
                run.token_ids.extend(tokens)
        self._num_hashed_blocks[seq.request_id] = max(start, num_full)

    def trim(self, seq: Sequence, num_tokens: int) -> bool:
        """Free the blocks of `seq` past the first `num_tokens` tokens (tail first): those a
        verify step allocated for drafts it rejected. They were never hashed (hashes stop
        at the computed tokens). Returns whether any block was freed, so the caller can
        tell the runner that the sequence's table shrank."""
        num_kept = -(-num_tokens // self.block_size)
        if len(seq.block_table) <= num_kept:
            return False
        for block_id in reversed(seq.block_table[num_kept:]):
            self.pool.free_block(self.pool.blocks[block_id])
        del seq.block_table[num_kept:]
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (tail first, so tail blocks are evicted first)."""
        for block_id in reversed(seq.block_table):
            self.pool.free_block(self.pool.blocks[block_id])
        seq.block_table.clear()
        self._num_hashed_blocks.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (e.g. after loading new weights)."""
        self.pool.reset_prefix_cache()
