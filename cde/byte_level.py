"""GPT-2's byte-level alphabet, shared by the Qwen3 and Steerling tokenizers.

Byte-level BPE vocabularies spell every byte as a printable character (GPT-2's
``bytes_to_unicode``); turning a token's spelling back into its exact bytes needs the inverse.
No dependencies: the gateway imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType


@lru_cache(maxsize=1)
def unicode_to_byte() -> Mapping[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in of each byte -> the byte.
    Read-only, since every caller shares the one cached table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + list(
        range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return MappingProxyType({chr(c): b for b, c in zip(bs, cs)})
