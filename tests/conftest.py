"""Project-wide test rules: tests marked `gpu` are skipped where CUDA is not available."""

from __future__ import annotations

import pytest
import torch


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
