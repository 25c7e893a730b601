"""The prefix block hash that render servers and workers compute identically.

A block's hash chains its parent's hash with the block's token ids, so equal hashes
mean equal prefixes (up to collisions of a 128-bit BLAKE2b). Tokens are packed as
little-endian uint32, so the value is the same on every machine and process; a test
vector committed in tests/unit/test_hashing.py pins it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
HASH_BYTES = 16
_ROOT_PERSON = b"duet-prefix-v1"
_LORA_ROOT_PERSON = b"duet-prefix-lora"


def root_hash(cache_salt: str | None = None, lora_name: str | None = None) -> BlockHash:
    """The parent of a sequence's first block.

    A per-tenant salt gives a separate tree, and so does each LoRA adapter: KV computed
    under one adapter is wrong for another or for the base model. The base model's roots
    are unchanged from before adapters existed; an adapter's root hashes the salt with its
    length in front under its own personalization, so no (salt, adapter) pair can collide
    with another pair or with a base root.
    """
    salt = (cache_salt or "").encode("utf-8")
    if lora_name is None:
        return hashlib.blake2b(salt, digest_size=HASH_BYTES, person=_ROOT_PERSON[:16]).digest()
    digest = hashlib.blake2b(digest_size=HASH_BYTES, person=_LORA_ROOT_PERSON)
    digest.update(struct.pack("<I", len(salt)))
    digest.update(salt)
    digest.update(lora_name.encode("utf-8"))
    return digest.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block given its parent's hash."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a partial last block has none)."""
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[BlockHash] = []
    parent = root_hash(cache_salt, lora_name)
    for i in range(num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
