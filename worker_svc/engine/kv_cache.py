"""Paged KV cache: page = 64 tokens = one diffusion block = one attention tile.

Physical page 0 is a scratch page: padding rows of a batch write there and read it, so real
requests never see its contents. Pages are handed out by a free list; a request's page
table maps its logical blocks 0..n to physical pages.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from worker_svc.engine.prefix_cache import Block, PrefixCache


class PagePool:
    """Free list, reference counts and (with `prefix_caching`) the cache of full prompt blocks:
    a page several requests share is freed when the last one releases it, and a cached page
    nobody holds stays reusable until an allocation needs it (prefix_cache.py)."""

    def __init__(self, n_pages: int, prefix_caching: bool = False):
        if n_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is scratch)")
        self.n_pages = n_pages
        self._free = list(range(n_pages - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * n_pages
        self.cache = PrefixCache() if prefix_caching else None

    @property
    def free(self) -> int:
        """Pages an allocation can get: free ones and cached ones nobody holds."""
        return len(self._free) + (self.cache.parked if self.cache is not None else 0)

    @property
    def usable(self) -> int:
        return self.n_pages - 1

    @property
    def used(self) -> int:
        return self.usable - self.free

    def alloc(self) -> int | None:
        if self._free:
            page = self._free.pop()
        else:
            evicted = self.cache.evict() if self.cache is not None else None
            if evicted is None:
                return None
            page, freed = evicted
            self._free.extend(freed)
        self._refs[page] = 1
        return page

    def release(self, pages: list[int]) -> None:
        # last block first: into the free list so that pop() hands out low ids first, and into
        # the cache's eviction order so that a prefix's deeper blocks go before its first ones
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if self.cache is not None and self.cache.holds(page):
                self.cache.park(page)
            else:
                self._free.append(page)

    def cached_prefix(self, blocks: Sequence[Block], namespace: Hashable = None) -> tuple[list[int], int]:
        """Pages of the longest cached prefix of `blocks`, and how many of them nobody holds
        (taking those uses up free pages)."""
        if self.cache is None:
            return [], 0
        pages = self.cache.match(blocks, namespace)
        return pages, sum(self.cache.is_parked(p) for p in pages)

    def share(self, pages: list[int]) -> None:
        """Take a reference to cached pages (a request reusing them)."""
        for page in pages:
            if self._refs[page] == 0:
                self.cache.unpark(page)
            self._refs[page] += 1

    def publish(self, blocks: Sequence[Block], pages: Sequence[int], namespace: Hashable = None) -> None:
        """The final K/V of `blocks` is in `pages`: later requests may reuse it."""
        if self.cache is not None:
            self.cache.insert(blocks, pages, namespace)


class KVCache:
    """K and V tensors shaped (layers, pages, 64, kv_heads, head_dim).

    Token-major inside a page: a gathered page table (rows, pages * 64, kv_heads, head_dim)
    is the usual (batch, seq, heads, dim) layout, so attention reads it through a transposed
    view instead of a copy into (batch, heads, seq, dim).
    """

    def __init__(self, n_layers: int, n_pages: int, n_kv: int, page: int, head_dim: int,
                 dtype: torch.dtype, device, prefix_caching: bool = False):
        shape = (n_layers, n_pages, page, n_kv, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = PagePool(n_pages, prefix_caching)
        self.page = page

    @staticmethod
    def bytes_per_page(n_layers: int, n_kv: int, page: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_kv * page * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def sized_from_free_memory(cls, cfg, dtype, device, fraction: float = 0.85, max_pages: int | None = None,
                               reserve_bytes: int = 0, prefix_caching: bool = False,
                               n_kv_heads: int | None = None) -> KVCache:
        """Pool sized from free device memory (after weights and graphs were allocated).
        n_kv_heads: the heads this process holds (a tensor-parallel rank's; default the model's)."""
        n_kv = n_kv_heads or cfg.n_kv_heads
        per_page = cls.bytes_per_page(cfg.n_layers, n_kv, cfg.diff_block_size, cfg.head_dim, dtype)
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            n = int((free * fraction - reserve_bytes) // per_page)
        else:
            n = max_pages or 256
        if max_pages is not None:
            n = min(n, max_pages)
        return cls(cfg.n_layers, max(n, 2), n_kv, cfg.diff_block_size, cfg.head_dim, dtype, device,
                   prefix_caching)
