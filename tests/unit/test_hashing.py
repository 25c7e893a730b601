"""The prefix block hash is pinned by a committed vector and stable across processes."""

from __future__ import annotations

import subprocess
import sys

from shared.hashing import hash_block, prefix_block_hashes, root_hash

TOKENS = list(range(1000, 1040))
# Computed once and committed: a change here breaks routing between mixed versions.
EXPECTED_HEX = [
    "f896d3d3d6cf5dd5603ccb17442cf12a",
    "95abfca542c9472e834d4b93a1632ce3",
]


def test_pinned_vector() -> None:
    hashes = prefix_block_hashes(TOKENS, block_size=16)
    assert [h.hex() for h in hashes] == EXPECTED_HEX


def test_only_full_blocks_are_hashed() -> None:
    assert len(prefix_block_hashes(TOKENS, 16)) == 2
    assert prefix_block_hashes(TOKENS[:15], 16) == []
    assert len(prefix_block_hashes(TOKENS, 16, max_blocks=1)) == 1


def test_chaining_and_prefix_property() -> None:
    a = prefix_block_hashes(TOKENS, 16)
    b = prefix_block_hashes(TOKENS[:16] + [7] * 16, 16)
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[1] == hash_block(a[0], TOKENS[16:32])
    # same block content under a different parent hashes differently
    assert hash_block(root_hash(), TOKENS[16:32]) != a[1]


def test_salt_separates_tenants() -> None:
    assert prefix_block_hashes(TOKENS, 16, "a") != prefix_block_hashes(TOKENS, 16, "b")
    assert prefix_block_hashes(TOKENS, 16, None) == prefix_block_hashes(TOKENS, 16, "")


def test_each_lora_adapter_has_its_own_tree() -> None:
    base = prefix_block_hashes(TOKENS, 16)
    alpha = prefix_block_hashes(TOKENS, 16, lora_name="alpha")
    assert alpha == prefix_block_hashes(TOKENS, 16, lora_name="alpha")
    assert alpha != base
    assert alpha != prefix_block_hashes(TOKENS, 16, lora_name="beta")
    assert alpha != prefix_block_hashes(TOKENS, 16, "t", lora_name="alpha")
    # the salt's length is hashed, so moving characters between salt and name changes the root
    assert root_hash("ab", "c") != root_hash("a", "bc")
    assert root_hash("", "alpha") != root_hash("alpha")


def test_stable_across_processes() -> None:
    code = (
        "from shared.hashing import prefix_block_hashes;"
        "print(','.join(h.hex() for h in prefix_block_hashes(list(range(1000, 1040)), 16)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out.split(",") == [h.hex() for h in prefix_block_hashes(TOKENS, 16)]
