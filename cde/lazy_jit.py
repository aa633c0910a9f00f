"""`triton.jit` applied on first use, once per mode, for every hand-written kernel.

`triton.jit` picks the CPU interpreter (TRITON_INTERPRET=1) or the compiler when it wraps a
function, so a kernel is wrapped lazily and cached per (function, mode): the tests' interpreter
children and the GPU path each get the right one.
"""

from __future__ import annotations

_JITTED: dict[tuple[str, str, bool], object] = {}


def jit(fn):
    """The jitted `fn` for the current mode (Triton must be importable)."""
    import triton

    key = (fn.__module__, fn.__qualname__, bool(triton.knobs.runtime.interpret))
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]
