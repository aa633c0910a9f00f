"""Regional compilation: a layer's pointwise functions, eager or each compiled once for all layers.

Used by cde/steerling/kernels.py and cde/qwen3/kernels.py: each names its pure functions; a
`Kernels` holds them as attributes (the layers call `self.kernels.<name>`), eager as written
or wrapped in `torch.compile` with dynamic shapes, so one graph per function serves every
layer and every row/page bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class Kernels:
    """The functions a layer calls, as attributes: eager, or wrapped by `wrap`."""

    def __init__(self, functions: Mapping[str, Callable], wrap: Callable[[Callable], Callable] | None = None):
        for name, fn in functions.items():
            setattr(self, name, wrap(fn) if wrap is not None else fn)


def compiled(functions: Mapping[str, Callable], backend="inductor") -> Kernels:
    """`functions` compiled with dynamic shapes (one graph each, whatever the rows, queries or pages)."""
    import torch.fx.experimental._config as fx_config
    fx_config.use_duck_shape = False   # equal sizes (pages == kv heads, queries == kv heads) must not share a symbol
    return Kernels(functions, lambda fn: torch.compile(fn, backend=backend, dynamic=True))
