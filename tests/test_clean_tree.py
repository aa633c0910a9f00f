"""tests/clean_tree.py fails a run that leaves the git working tree changed, and only such a run."""

from __future__ import annotations

import os
import subprocess
import sys

from cde.launch import ROOT

INNER_TEST = '''
from pathlib import Path

def test_writes(tmp_path):
    if {write!r}:
        Path("data.txt").write_text("rewritten by a test\\n")
    (tmp_path / "scratch.txt").write_text("fine")
'''


def run_inner(tmp_path, write: bool) -> subprocess.CompletedProcess:
    repo = tmp_path / ("dirty" if write else "clean")
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    (repo / "data.txt").write_text("committed\n")
    (repo / "test_inner.py").write_text(INNER_TEST.format(write=write))
    (repo / ".gitignore").write_text("__pycache__/\n")
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=repo, check=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.clean_tree",
                           "test_inner.py"], cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_that_rewrites_a_tracked_file_fails(tmp_path):
    proc = run_inner(tmp_path, write=True)
    assert proc.returncode == 1, proc.stdout
    assert "changed the git working tree" in proc.stdout and "M data.txt" in proc.stdout, proc.stdout


def test_a_run_that_writes_only_under_tmp_path_passes(tmp_path):
    proc = run_inner(tmp_path, write=False)
    assert proc.returncode == 0, proc.stdout
    assert "changed the git working tree" not in proc.stdout
