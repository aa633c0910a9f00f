"""Quick start command 1 on a fresh clone: `bash scripts/start.sh` makes .venv from
requirements.txt alone (what the Dockerfile installs), starts the whole stack and serves the demo
request. Run here with `--exit` (passed on to `python -m cde.launch --demo`), so a module that the
services import but requirements.txt lacks fails this test, even where the test requirements
happen to bring it. It also checks that the launcher leaves nothing in the temporary directory.

The clone is of HEAD: uncommitted changes are not in it. pip uses its usual cache."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from cde.launch import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 1200   # pip install (torch from the wheel cache) plus the stack's start under load


def clean_env(tmpdir) -> dict[str, str]:
    """The user's environment without this test run's virtualenv or import paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    env["TMPDIR"] = str(tmpdir)
    return env


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("python3") is None, reason="needs git and python3")
def test_quick_start_serves_the_demo_from_a_fresh_clone(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    try:
        proc = subprocess.run(["bash", "scripts/start.sh", "--exit"], cwd=clone, env=clean_env(tmpdir),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"start.sh did not finish in {TIMEOUT_S} s (clone of {head}):\n{(e.stdout or '')[-4000:]}")
    out = proc.stdout
    where = f"(clone of {head}; uncommitted changes are not in it)\nstdout:\n{out[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"start.sh exited {proc.returncode} {where}"
    assert (clone / ".venv" / "bin" / "python").exists(), where
    for line in ("gateway    healthy", "ready: REST http://127.0.0.1:", "(cde.v1.Generation)",
                 "demo request: POST /v1/chat/completions (steer: sea, attribution: chunks)",
                 "  text: ", "  finish: ", "  chunk [", "stopping ..."):
        assert line in out, f"missing {line!r} {where}"
    assert "--steer sea --attribution chunks" in out, where
    left = sorted(p.name for p in tmpdir.iterdir())
    assert not [n for n in left if n.startswith("cde-run-")], f"the launcher left its run directory: {left}"
