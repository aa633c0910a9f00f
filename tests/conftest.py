"""Project-wide test rules: tests marked `gpu` are skipped where CUDA is not available; a run that
changes the git working tree fails (tests/clean_tree.py)."""

from __future__ import annotations

import pytest
import torch

from tests.clean_tree import pytest_sessionfinish, pytest_sessionstart  # noqa: F401 - hooks


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def report(capsys, request):
    """Print a figure for the notes even under -q (pytest would capture it otherwise), tagged
    with the module's REPORT_TAG."""
    tag = getattr(request.module, "REPORT_TAG", "report")

    def emit(msg: str) -> None:
        with capsys.disabled():
            print(f"\n[{tag}] {msg}", flush=True)
    return emit
