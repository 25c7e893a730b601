"""GPT-2's byte-level alphabet: the printable character that stands for each byte in the
vocabularies of byte-level BPE tokenizers (Llama 3, Qwen2, SmolLM2, ...). Both tiers spell
tokens as bytes with it: the render tier to detokenize, the worker to build grammars."""

from __future__ import annotations

import functools


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """byte -> character; printable Latin-1 bytes stand for themselves, the rest get 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """character -> byte, the inverse of `bytes_to_unicode`."""
    return {char: byte for byte, char in bytes_to_unicode().items()}
