"""The services' module graph, read with `ast` (nothing is imported), for
tests/test_module_boundaries.py: import cycles between modules, private names taken from
another module (`from x import _y`, `x._y`), and private methods called on another module's
objects (`obj._m(...)` where `_m` is defined in some other project module but not the caller's).

    found = scan(ROOT)      # Findings(cycles, private_imports, private_calls), each a list of lines
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("cde", "gateway", "scheduler_svc", "worker_svc", "steering_svc", "attribution_svc")
SKIP_DIRS = {"__pycache__", "v1"}   # cde/rpc/v1: generated protobuf stubs


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_DIRS & set(rel.parts[:-1]):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def resolve_from(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class ModuleScan(ast.NodeVisitor):
    def __init__(self, mod: str, is_pkg: bool, known: set[str]):
        self.mod, self.is_pkg, self.known = mod, is_pkg, known
        self.edges: list[tuple[str, int, str]] = []          # (target module, line, kind)
        self.private_imports: list[tuple[int, str]] = []
        self.module_aliases: dict[str, str] = {}              # local name -> project module
        self.private_module_attrs: list[tuple[int, str]] = []
        self.method_calls: list[tuple[int, str, str]] = []    # (line, receiver, _name)
        self.defined: set[str] = set()                        # functions/methods defined here
        self._depth = 0
        self._typing = 0

    def _kind(self) -> str:
        return "typing" if self._typing else ("lazy" if self._depth else "top")

    def _project(self, name: str) -> str | None:
        """The longest project module that `name` is or lies in."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in self.known:
                return cand
        return None

    # scopes
    def _func(self, node):
        self.defined.add(node.name)
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _func

    def visit_Lambda(self, node):
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    def visit_If(self, node):
        test = node.test
        typing = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                 (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        if typing:
            self._typing += 1
            for n in node.body:
                self.visit(n)
            self._typing -= 1
            for n in node.orelse:
                self.visit(n)
        else:
            self.generic_visit(node)

    # imports
    def visit_Import(self, node):
        for alias in node.names:
            target = self._project(alias.name)
            if target:
                self.edges.append((target, node.lineno, self._kind()))
                if alias.asname:
                    self.module_aliases[alias.asname] = target
                else:
                    top = alias.name.split(".")[0]
                    if top in self.known:
                        self.module_aliases[top] = top

    def visit_ImportFrom(self, node):
        base = resolve_from(self.mod, self.is_pkg, node)
        base_mod = self._project(base)
        if base_mod is None:
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.known:   # `from pkg import submodule`
                self.edges.append((sub, node.lineno, self._kind()))
                self.module_aliases[alias.asname or alias.name] = sub
            else:
                self.edges.append((base_mod, node.lineno, self._kind()))
                if is_private(alias.name):
                    self.private_imports.append((node.lineno, f"from {base} import {alias.name}"))

    # private use
    def visit_Attribute(self, node):
        if is_private(node.attr) and isinstance(node.value, ast.Name) and node.value.id in self.module_aliases:
            self.private_module_attrs.append((node.lineno, f"{node.value.id}.{node.attr}"
                                              f" ({self.module_aliases[node.value.id]})"))
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Attribute) and is_private(f.attr):
            recv = f.value
            own = (isinstance(recv, ast.Name) and recv.id in ("self", "cls")) or \
                  (isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super")
            if not own and not (isinstance(recv, ast.Name) and recv.id in self.module_aliases):
                self.method_calls.append((node.lineno, ast.unparse(recv), f.attr))
        self.generic_visit(node)


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)



@dataclass
class Findings:
    cycles: list[str]
    private_imports: list[str]
    private_calls: list[str]


def scan(root: Path, packages=PACKAGES) -> Findings:
    mods = find_modules(root, packages)
    known = set(mods)
    scans = {}
    for mod, path in mods.items():
        s = ModuleScan(mod, path.name == "__init__.py", known)
        s.visit(ast.parse(path.read_text(), str(path)))
        scans[mod] = s
    graph = defaultdict(set)
    for mod, s in scans.items():
        for target, _, _ in s.edges:
            if target != mod:
                graph[mod].add(target)

    cycles = []
    for comp in sccs(graph):
        members = set(comp)
        edges = [f"{mods[m].relative_to(root)}:{line} {m} -> {t} [{kind}]"
                 for m in comp for t, line, kind in sorted(set(scans[m].edges)) if t in members and t != m]
        cycles.append(" <-> ".join(comp) + ": " + "; ".join(edges))

    private_imports = [f"{mods[m].relative_to(root)}:{line} {text}" for m, s in sorted(scans.items())
                       for line, text in s.private_imports + s.private_module_attrs]

    defined_in = defaultdict(set)
    for mod, s in scans.items():
        for name in s.defined:
            defined_in[name].add(mod)
    private_calls = []
    for mod, s in sorted(scans.items()):
        for line, recv, name in s.method_calls:
            owners = defined_in.get(name, set())
            if name in s.defined or not owners:
                continue   # its own private method, or not a project name (stdlib, grpc internals)
            private_calls.append(f"{mods[mod].relative_to(root)}:{line} {recv}.{name}(...) "
                                 f"[{name} defined in {', '.join(sorted(owners))}]")
    return Findings(cycles, private_imports, private_calls)
