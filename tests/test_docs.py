"""The repository's docs are self-contained: nothing a user or contributor reads points outside
a clone (paths of the development setup, tools only its developers have), and every relative
link in README.md and docs/ resolves to a file in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cde.launch import ROOT

# Paths and names of the environment the project was developed in; a clone has none of them.
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])shared/(?:perf|spec|DESIGN|hooks)|/work/|device tool|the `device`")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".yaml", ".yml", ".proto", ".toml", ".ini", ""}
# Measured records keep the command lines they ran with; this file names the patterns.
EXEMPT = ("bench/results/", "tests/test_docs.py")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout: {e}")
    return [f for f in out.stdout.splitlines() if not f.startswith(EXEMPT)]


def test_nothing_points_outside_the_repository():
    hits = []
    for name in tracked_files():
        path = ROOT / name
        if path.suffix not in TEXT_SUFFIXES or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    text = (ROOT / doc).read_text()
    broken = [t for t in LINK.findall(text)
              if not re.match(r"[a-z]+:", t) and not ((ROOT / doc).parent / t).exists()]
    assert not broken, f"{doc}: links to missing files: {broken}"


def test_the_pattern_catches_what_the_docs_used_to_say():
    for line in ("`../shared/DESIGN.md` for the target design", "(shared/spec/steerling.md)",
                 "the method of `shared/perf/gpu_floor.py`", "See ``/work/shared/spec/isd.md``",
                 "one NVIDIA H200 (the `device` tool)"):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("a shared/library path") and not OUTSIDE.search("the shared step loop")
