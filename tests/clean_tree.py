"""A pytest plugin: the run fails when the tests changed the git working tree (tests write only
under temporary paths). It compares `git status --porcelain` at the start and at the end of the
session, so a tree that was already dirty is judged only by what the tests added to it.
Loaded by tests/conftest.py; tests/test_clean_tree.py checks that it catches a write."""

from __future__ import annotations

import subprocess

import pytest

_BEFORE = pytest.StashKey[frozenset[str] | None]()


def git_status(root) -> frozenset[str] | None:
    """The porcelain lines (untracked files listed one by one), None outside a git checkout."""
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return frozenset(proc.stdout.splitlines()) if proc.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_BEFORE] = git_status(session.config.rootpath)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.stash.get(_BEFORE, None)
    after = git_status(session.config.rootpath) if before is not None else None
    if before is None or after is None:
        return
    added = sorted(after - before)
    if not added:
        return
    lines = ["the tests changed the git working tree (write under tmp_path instead):", *added]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
