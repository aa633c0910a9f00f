"""Project-wide test rules and the fixtures every test module can take without importing them.

Rules: tests marked `gpu` are skipped where CUDA is not available; a run that changes the git
working tree fails (tests/clean_tree.py); a failing test that drew a seed reports it
(tests/seeding.py). Test modules never import each other (tests/test_suite_hygiene.py): what
two of them share lives in a helper module under tests/ whose name does not start with test_.

Fixtures any test can take without importing them (the plugins below):
  seed                         tests/seeding.py: a fresh seed, or $CDE_TEST_SEED, printed on failure
  redis_server, redis_client   tests/redis_fixture.py: a real redis-server for the session
  stack                        tests/stack_fixture.py: the default stack as processes, one per module
  report                       below: a figure for the notes, printed even under -q
Helpers to import: tests/tiny_models.py (random tiny Qwen3 / lag models, a random LoRA: every
builder takes its seed), tests/stack_fixture.py (running_stack and the stack's clients),
tests/triton_child.py (kernels under Triton's CPU interpreter in a child process), oracle.py.
"""

from __future__ import annotations

import importlib.util

import pytest

# Helpers shared by test modules get pytest's assertion messages too (before anything imports them).
pytest.register_assert_rewrite("tests")

import torch  # noqa: E402

from tests.clean_tree import pytest_sessionfinish, pytest_sessionstart  # noqa: E402,F401 - hooks

# The Redis and stack plugins need the test requirements' redis + httpx; a GPU host that runs only
# the `gpu` tests (bench/run_h200.sh gpu-tests) may lack them, and those tests do not use them.
pytest_plugins = ["tests.seeding"] + (["tests.redis_fixture", "tests.stack_fixture"]
                                      if all(importlib.util.find_spec(m) for m in ("redis", "httpx")) else [])


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
