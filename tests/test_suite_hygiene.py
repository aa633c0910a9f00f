"""The test suite's own rules (issue 18):

* no test module imports another test module (nor does a helper, nor a child process started
  with ``-c "from tests.test_x import ..."``): what two of them share lives in a helper module
  under tests/ whose name does not start with ``test_``;
* no test module draws a seed pytest does not know about (its own ``fresh_seed``,
  ``random.SystemRandom``, the global ``random`` functions): fresh seeds come from the ``seed``
  fixture or ``draw_seed()`` (tests/seeding.py);
* a failing test that drew a seed reports it, whatever phase failed, and ``CDE_TEST_SEED`` set
  to that seed replays every draw of the test (checked on a tiny pytest run in a subprocess).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.seeding import SEED_ENV

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TEST_MODULE = re.compile(r"^test_\w*$")
# a child process's entry point given as code: run_child("from tests.test_x import f; f()")
IMPORT_IN_CODE = re.compile(r"\b(?:from|import)\s+(?:tests\.)?(test_\w+)")
# module-level functions of `random` that draw from the global, unseeded generator
GLOBAL_RANDOM = {"random", "randrange", "randint", "choice", "choices", "sample", "shuffle", "uniform",
                 "gauss", "getrandbits", "randbytes"}


def python_files() -> list[Path]:
    """Every module under tests/ but this one (whose samples break the rules on purpose)."""
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts and p != Path(__file__).resolve())


def is_test_module(path: Path) -> bool:
    return bool(TEST_MODULE.match(path.stem))


def imported_test_modules(source: str) -> list[str]:
    """Test modules `source` imports: `tests.test_x`, or `test_x` (pytest puts tests/ itself on
    sys.path), or relatively; also inside functions and in code strings run as a child."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] if base else []
            names += [f"{base}.{a.name}" if base else a.name for a in node.names] if node.level or base == "tests" else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = IMPORT_IN_CODE.findall(node.value)
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests":
                parts = parts[1:]
            if parts and TEST_MODULE.match(parts[0]):
                found.append(parts[0])
    return found


def unrecorded_seeds(source: str) -> list[str]:
    """Seed sources pytest would not report: a local fresh_seed, SystemRandom, global random draws."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "fresh_seed":
            found.append(f"line {node.lineno}: defines fresh_seed")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "random" \
                and (node.attr == "SystemRandom" or node.attr in GLOBAL_RANDOM):
            found.append(f"line {node.lineno}: random.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "random":
            found += [f"line {node.lineno}: from random import {a.name}" for a in node.names
                      if a.name == "SystemRandom" or a.name in GLOBAL_RANDOM]
    return found


def test_the_checks_see_what_they_forbid():
    """Each rule on sources that break it (and on ones that do not), so the suite checks below can fail."""
    assert imported_test_modules("from tests.test_isd import run_child") == ["test_isd"]
    assert imported_test_modules("import tests.test_faults as f") == ["test_faults"]
    assert imported_test_modules("from tests import test_faults, stack_fixture") == ["test_faults"]
    assert imported_test_modules("from test_isd import random_lora") == ["test_isd"]
    assert imported_test_modules("from . import test_isd") == ["test_isd"]
    assert imported_test_modules("def f():\n    from tests.test_isd_engine import tiny_model") == ["test_isd_engine"]
    assert imported_test_modules('run_child("from tests.test_isd import triton_child; triton_child()", True)') \
        == ["test_isd"]
    assert imported_test_modules("from tests.stack_fixture import running_stack\nimport testing\n"
                                 "from tests.tiny_models import tiny_model\nx = 'the test_isd module'") == []
    assert len(unrecorded_seeds("import random\ndef fresh_seed():\n    return random.SystemRandom().randrange(9)")) == 2
    assert unrecorded_seeds("import random\nx = random.randrange(2**32)") == ["line 2: random.randrange"]
    assert unrecorded_seeds("from random import SystemRandom") == ["line 1: from random import SystemRandom"]
    assert unrecorded_seeds("import random\nrng = random.Random(seed)\nrng.shuffle(xs)\n"
                            "body = '{\"seed\": random.randrange(1 << 30)}'") == []


def test_no_test_module_is_imported_by_another_module():
    offenders = {str(p.relative_to(ROOT)): mods for p in python_files()
                 if (mods := imported_test_modules(p.read_text()))}
    assert not offenders, ("move what these share into a helper module under tests/ (not named test_*): "
                           f"{offenders}")


def test_no_test_module_draws_a_seed_pytest_does_not_report():
    offenders = {str(p.relative_to(ROOT)): found for p in python_files() if is_test_module(p)
                 if (found := unrecorded_seeds(p.read_text()))}
    assert not offenders, f"take the `seed` fixture or call tests.seeding.draw_seed(): {offenders}"


SEEDED = textwrap.dedent('''
    import os
    import pytest
    from tests.seeding import draw_seed

    def record(name, *seeds):
        with open(os.path.join(os.environ["SEEDS_OUT"], name), "w") as f:
            f.write(" ".join(map(str, seeds)))

    def test_fails_with_its_seed(seed):
        record("fails", seed, draw_seed(), draw_seed())
        assert seed < 0

    def test_passes(seed):
        record("passes", seed)

    def test_draws_in_a_helper_and_raises():
        record("helper", draw_seed())
        raise RuntimeError("boom")

    @pytest.fixture
    def broken(seed):
        record("setup", seed)
        raise RuntimeError("set-up broke")

    def test_setup_fails(broken):
        pass

    def test_fails_without_a_seed():
        assert 1 == 2
''')


def run_seeded(tmp_path: Path, out: str, seed_env: str | None, *args: str) -> tuple[str, dict[str, list[int]]]:
    """pytest on SEEDED in a child process (this repo's seeding plugin, nothing else of ours):
    (its output, the seeds each test recorded)."""
    (tmp_path / "test_seeded.py").write_text(SEEDED)
    out_dir = tmp_path / out
    out_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (SEED_ENV, "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(ROOT), SEEDS_OUT=str(out_dir), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if seed_env is not None:
        env[SEED_ENV] = seed_env
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.seeding", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *args, "test_seeded.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    seeds = {p.name: [int(x) for x in p.read_text().split()] for p in out_dir.iterdir()}
    return proc.stdout, seeds


def failure_sections(output: str) -> dict[str, str]:
    """test name -> its block in the FAILURES / ERRORS sections of pytest's output."""
    blocks = re.split(r"^_{3,} (?:ERROR at setup of )?(\w+) _{3,}$", output, flags=re.M)
    return {name: body for name, body in zip(blocks[1::2], blocks[2::2])}


def test_a_failing_seeded_test_reports_its_seed_and_the_seed_replays_it(tmp_path):
    output, seeds = run_seeded(tmp_path, "fresh", None, "-q", "--show-capture=no")
    failed = failure_sections(output)
    assert set(failed) == {"test_fails_with_its_seed", "test_draws_in_a_helper_and_raises", "test_setup_fails",
                           "test_fails_without_a_seed"}, output
    for test, name in (("test_fails_with_its_seed", "fails"), ("test_draws_in_a_helper_and_raises", "helper"),
                       ("test_setup_fails", "setup")):
        first = seeds[name][0]
        assert f"seed={first}\n" in failed[test], f"{test} does not report seed {first}:\n{failed[test]}"
        assert f"{SEED_ENV}={first} " in failed[test] and f"::{test}" in failed[test], failed[test]
    assert "seed=" not in failed["test_fails_without_a_seed"], failed["test_fails_without_a_seed"]
    assert f"seed={seeds['passes'][0]}" not in output, "a passing test's seed is noise"
    # three draws: later ones follow from the first, and the report lists them all
    assert str(seeds["fails"]) in failed["test_fails_with_its_seed"], failed["test_fails_with_its_seed"]
    assert len(set(seeds["fails"])) == 3, seeds

    # the reported seed replays the whole test: every draw, in order
    _, replay = run_seeded(tmp_path, "replay", str(seeds["fails"][0]), "-q", "-k", "test_fails_with_its_seed")
    assert replay["fails"] == seeds["fails"], (replay, seeds)

    _, fixed = run_seeded(tmp_path, "fixed", "4242", "-q")
    assert fixed["fails"][0] == fixed["passes"][0] == fixed["helper"][0] == fixed["setup"][0] == 4242, fixed


def test_a_seed_that_is_not_an_integer_is_a_usage_error(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one(seed):\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **{SEED_ENV: "12ab"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.seeding", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "test_one.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"{SEED_ENV} must be an integer, got '12ab'" in proc.stdout + proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("module", ["tests.seeding", "tests.redis_fixture", "tests.stack_fixture"])
def test_conftest_loads_the_shared_fixtures(module, request):
    """The fixtures conftest.py promises (seed, redis_server, redis_client, stack) need no import."""
    plugin = request.config.pluginmanager.get_plugin(module)
    assert plugin is not None, f"conftest.py does not load {module}"
