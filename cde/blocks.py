"""Block geometry shared by every service: one diffusion block = one KV page = one attention tile.

Torch-free, so the gateway and scheduler can import it. Changing BLOCK changes the public
contract (cde.v1: block_index = start // BLOCK) and the KV layout at once.
"""
from __future__ import annotations

BLOCK = 64   # tokens per diffusion block, per committed Block event, per KV page
PAGE = BLOCK


def pages_for(n_tokens: int) -> int:
    """KV pages needed to hold n_tokens positions (ceil division by PAGE)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    return -(-n_tokens // PAGE)
