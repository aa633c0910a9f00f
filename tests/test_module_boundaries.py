"""No import cycles and no private cross-module use in the services (issue 34): modules depend
one way, and what another module needs is public. tests/module_graph.py reads the source with
`ast`; the checker is itself tested on a small package that has each fault."""

from __future__ import annotations

from pathlib import Path

from tests.module_graph import scan

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_cycles_between_modules():
    found = scan(ROOT)
    assert not found.cycles, "\n".join(found.cycles)


def test_no_private_names_or_methods_used_across_modules():
    found = scan(ROOT)
    assert not found.private_imports, "\n".join(found.private_imports)
    assert not found.private_calls, "\n".join(found.private_calls)


def test_the_checker_finds_a_cycle_a_private_import_and_a_private_call(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import _helper\n\nclass A:\n    def _hook(self):\n        pass\n")
    (pkg / "b.py").write_text("def _helper():\n    from pkg import a\n    return a\n\n"
                              "def use(obj):\n    return obj._hook()\n")
    found = scan(tmp_path, packages=("pkg",))
    assert len(found.cycles) == 1 and "pkg.a <-> pkg.b" in found.cycles[0], found.cycles
    assert any("from pkg.b import _helper" in x for x in found.private_imports), found.private_imports
    assert any("obj._hook(...)" in x for x in found.private_calls), found.private_calls
