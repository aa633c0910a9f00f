"""Fresh seeds for randomized tests, and the seed in the report of every test that fails.

A test takes the ``seed`` fixture, or calls ``draw_seed()`` where it needs a seed inside a helper
or a loop. The first seed a test draws is fresh (``random.SystemRandom``), or ``$CDE_TEST_SEED``
when that is set; every later draw in the same test comes from ``random.Random(first)``, so the
first seed alone replays the whole test::

    CDE_TEST_SEED=123456 .venv/bin/python -m pytest -q "tests/test_isd.py::test_greedy_isd_matches_greedy_ar"

When a test that drew a seed fails (in set-up, call or teardown), its report gets a ``seed``
section with that command line, and a ``seed`` junit property. A pytest plugin: conftest.py
loads it; a pytest run elsewhere can load it with ``-p tests.seeding``.
"""

from __future__ import annotations

import os
import random
import shlex

import pytest

SEED_ENV = "CDE_TEST_SEED"
SEED_LIMIT = 1 << 30   # seeds fit torch.Generator, numpy and the model inits alike


def _first_seed() -> int:
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return random.SystemRandom().randrange(SEED_LIMIT)
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {text!r}") from None


class SeedLog:
    """The seeds one test drew, in order; the first one determines the rest."""

    def __init__(self) -> None:
        self.drawn: list[int] = []
        self._rng: random.Random | None = None

    def draw(self) -> int:
        if self._rng is None:
            seed = _first_seed()
            self._rng = random.Random(seed)
        else:
            seed = self._rng.randrange(SEED_LIMIT)
        self.drawn.append(seed)
        return seed

    def describe(self, nodeid: str) -> str:
        first = self.drawn[0]
        text = f"seed={first}\nreproduce: {SEED_ENV}={first} .venv/bin/python -m pytest -q {shlex.quote(nodeid)}"
        if len(self.drawn) > 1:
            text += f"\nthe {len(self.drawn)} seeds this test drew (later ones follow from the first): {self.drawn}"
        return text


SEEDS_KEY = pytest.StashKey[SeedLog]()
_current = SeedLog()   # draws outside any test (collection time) are fresh and recorded nowhere


def draw_seed() -> int:
    """The current test's next seed (see the module docstring)."""
    return _current.draw()


@pytest.fixture
def seed() -> int:
    """The current test's first seed: fresh, or $CDE_TEST_SEED; printed when the test fails."""
    return draw_seed()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # before any fixture of this test is set up: its draws (module-scoped fixtures included) are its own
    global _current
    _current = item.stash[SEEDS_KEY] = SeedLog()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    seeds = item.stash.get(SEEDS_KEY, None)
    if report.failed and seeds is not None and seeds.drawn:
        text = seeds.describe(item.nodeid)
        if hasattr(report.longrepr, "addsection"):   # printed with the traceback, whatever --show-capture says
            report.longrepr.addsection("seed", text)
        else:
            report.sections.append(("seed", text))
        if ("seed", seeds.drawn[0]) not in item.user_properties:
            item.user_properties.append(("seed", seeds.drawn[0]))
    return report
