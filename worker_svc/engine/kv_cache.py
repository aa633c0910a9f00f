"""Paged KV cache: page = 64 tokens = one diffusion block = one attention tile.

Physical page 0 is a scratch page: padding rows of a batch write there and read it, so real
requests never see its contents. Pages are handed out by a free list; a request's page
table maps its logical blocks 0..n to physical pages.
"""

from __future__ import annotations

import torch


class PagePool:
    def __init__(self, n_pages: int):
        if n_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is scratch)")
        self.n_pages = n_pages
        self._free = list(range(n_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        return self.n_pages - 1

    @property
    def used(self) -> int:
        return self.usable - self.free

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVCache:
    """K and V tensors shaped (layers, pages, 64, kv_heads, head_dim).

    Token-major inside a page: a gathered page table (rows, pages * 64, kv_heads, head_dim)
    is the usual (batch, seq, heads, dim) layout, so attention reads it through a transposed
    view instead of a copy into (batch, heads, seq, dim).
    """

    def __init__(self, n_layers: int, n_pages: int, n_kv: int, page: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (n_layers, n_pages, page, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = PagePool(n_pages)
        self.page = page

    @staticmethod
    def bytes_per_page(n_layers: int, n_kv: int, page: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv * page * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def sized_from_free_memory(cls, cfg, dtype, device, fraction: float = 0.85, max_pages: int | None = None,
                               reserve_bytes: int = 0) -> KVCache:
        """Pool sized from free device memory (after weights and graphs were allocated)."""
        per_page = cls.bytes_per_page(cfg.n_layers, cfg.n_kv_heads, cfg.diff_block_size, cfg.head_dim, dtype)
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            n = int((free * fraction - reserve_bytes) // per_page)
        else:
            n = max_pages or 256
        if max_pages is not None:
            n = min(n, max_pages)
        return cls(cfg.n_layers, max(n, 2), cfg.n_kv_heads, cfg.diff_block_size, cfg.head_dim, dtype, device)
