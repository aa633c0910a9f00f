"""Prefix caching: a radix over full 64-token blocks whose K/V pages later requests reuse.

A block's K/V depends only on its own tokens and the tokens before it (commit rows of a Steerling
request are never steered; a causal model's K/V is causal), so a trie whose edges are whole
blocks maps a token prefix to the pages holding its K/V exactly. Requests whose K/V of the same
tokens differ (an ISD request with its LoRA on clean positions too) use a trie of their own
(`namespace`). The page pool owns the
reference counts; a cached page nobody holds is parked here and evicted, least recently
released first, when the pool runs out of free pages. Evicting a block also drops every block
under it (they are unreachable without it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

Block = tuple[int, ...]


class _Node:
    __slots__ = ("page", "children", "parent", "key")

    def __init__(self, page: int, parent: _Node | None, key: Block | None):
        self.page = page
        self.children: dict[Block, _Node] = {}
        self.parent = parent
        self.key = key


class PrefixCache:
    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._by_page: dict[int, _Node] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()   # cached pages with no holder, oldest first

    @property
    def parked(self) -> int:
        return len(self._parked)

    def is_parked(self, page: int) -> bool:
        return page in self._parked

    def holds(self, page: int) -> bool:
        return page in self._by_page

    def _root(self, namespace: Hashable) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(-1, None, None)
        return root

    def match(self, blocks: Sequence[Block], namespace: Hashable = None) -> list[int]:
        """Pages of the longest cached prefix of `blocks` (references are the pool's to take)."""
        node, pages = self._root(namespace), []
        for key in blocks:
            node = node.children.get(key)
            if node is None:
                break
            pages.append(node.page)
        return pages

    def insert(self, blocks: Sequence[Block], pages: Sequence[int], namespace: Hashable = None) -> None:
        """Cache `pages[i]` as the K/V of `blocks[:i + 1]`. A block cached already (by another
        request) keeps its page; this request's copy of it stays private."""
        node = self._root(namespace)
        for key, page in zip(blocks, pages):
            child = node.children.get(key)
            if child is None:
                if page in self._by_page:   # this page is cached for another prefix: cannot be (it holds these tokens)
                    return
                child = node.children[key] = _Node(page, node, key)
                self._by_page[page] = child
            node = child

    def park(self, page: int) -> None:
        self._parked[page] = None

    def unpark(self, page: int) -> None:
        self._parked.pop(page, None)

    def evict(self) -> tuple[int, list[int]] | None:
        """Uncache the least recently released parked block and every block under it. Returns its
        page and the other parked pages freed with it, or None when nothing is parked."""
        if not self._parked:
            return None
        page, _ = self._parked.popitem(last=False)
        node = self._by_page[page]
        del node.parent.children[node.key]
        freed: list[int] = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            del self._by_page[n.page]
            if n.page in self._parked:
                del self._parked[n.page]
                freed.append(n.page)
        del self._by_page[page]
        return page, freed
