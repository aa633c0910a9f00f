"""Triton code run in a child process: the CPU interpreter must be switched on
(``TRITON_INTERPRET=1``) before ``triton`` is imported, since its own jit helpers are built at
import, so kernels under the interpreter never run in the pytest process itself. A child's entry
point lives in a helper module (never a test module), e.g.
``run_child("from tests.verify_cases import triton_child; triton_child()", interpret=True)``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_child(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)   # the interpreter on a shared 2-core machine


def sm90_compile_child(kernels: list[tuple[str, str, dict]], types: dict[str, str]) -> None:
    """Child entry point: compile each (module, function name, constexprs) kernel for sm_90 (no
    GPU needed: the compiled dialect is stricter than the interpreter) through a fresh
    `triton.jit` of the module's plain function, whose constexpr parameters must be exactly the
    given ones. Parameters are typed from `types` (pointers, floats), others as i32. Prints one
    JSON object: "module.function {constexprs}" -> the compiled artifacts' kinds."""
    import importlib
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for module, name, consts in kernels:
        jit = triton.jit(getattr(importlib.import_module(module), name))
        names = {p.name for p in jit.params if p.is_constexpr}
        assert names == set(consts), (module, name, sorted(names), sorted(consts))
        sig = {p.name: "constexpr" if p.name in consts else types.get(p.name, "i32") for p in jit.params}
        compiled = triton.compile(ASTSource(jit, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        report[f"{module}.{name} {consts}"] = sorted(compiled.asm)
    print(json.dumps(report))


def assert_compiles_for_sm90(kernels: list[tuple[str, str, dict]], types: dict[str, str]) -> None:
    """Run `sm90_compile_child` in a child process (compiler, not interpreter) and check every
    kernel produced a cubin."""
    import json

    proc = run_child(f"from tests.triton_child import sm90_compile_child; sm90_compile_child({kernels!r}, {types!r})",
                     interpret=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(kernels) and all("cubin" in asm for asm in report.values()), report


def child_report(code: str, interpret: bool, argv: tuple = ()) -> dict:
    """Run `code` in a child (sys.argv = ['child', *argv]) and return the JSON object its last
    output line prints; a failing child fails the test with its output (and argv: the seed)."""
    import json

    proc = run_child(f"import sys; sys.argv = ['child', *{[str(a) for a in argv]!r}]\n" + code, interpret=interpret)
    assert proc.returncode == 0, f"argv {argv}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
