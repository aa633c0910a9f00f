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
