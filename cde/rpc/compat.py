"""Backward-compatibility check of the cde.v1 contracts against the golden descriptor set.

A change is compatible when every message, field, enum value, service and method of the
golden set still exists unchanged in the current set: same field number, name, type,
label, presence and oneof; a field or enum value may only disappear if its number is
reserved; reserved numbers and names are never reused; methods keep their request and
response types and streaming flags. Field names count because the JSON form (REST,
logs) uses them. New messages, fields, values, services and methods are always fine.

    python -m cde.rpc.compat protos/golden/cde_v1.binpb current.binpb
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Iterable, Iterator

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pb2 import (DescriptorProto, EnumDescriptorProto, FieldDescriptorProto,
                                            FileDescriptorSet, ServiceDescriptorProto)


def _messages(prefix: str, messages: Iterable[DescriptorProto]) -> Iterator[tuple[str, DescriptorProto]]:
    for m in messages:
        name = f"{prefix}.{m.name}"
        yield name, m
        yield from _messages(name, m.nested_type)


def _index(fds: FileDescriptorSet):
    messages: dict[str, DescriptorProto] = {}
    enums: dict[str, EnumDescriptorProto] = {}
    services: dict[str, ServiceDescriptorProto] = {}
    for f in fds.file:
        pkg = f".{f.package}" if f.package else ""
        for name, m in _messages(pkg, f.message_type):
            messages[name] = m
            enums.update({f"{name}.{e.name}": e for e in m.enum_type})
        enums.update({f"{pkg}.{e.name}": e for e in f.enum_type})
        services.update({f"{pkg}.{s.name}": s for s in f.service})
    return messages, enums, services


def _reserved(ranges, number: int, end_inclusive: bool) -> bool:
    return any(r.start <= number < r.end + (1 if end_inclusive else 0) for r in ranges)


def _oneof(m: DescriptorProto, f: FieldDescriptorProto) -> str:
    """The real oneof a field belongs to ('' for none or a proto3 `optional`'s synthetic one)."""
    if not f.HasField("oneof_index") or f.proto3_optional:
        return ""
    return m.oneof_decl[f.oneof_index].name


def _type(f: FieldDescriptorProto) -> str:
    t = FieldDescriptorProto.Type.Name(f.type)
    return f"{t}({f.type_name})" if f.type_name else t


def _check_message(name: str, old: DescriptorProto, new: DescriptorProto) -> list[str]:
    problems = []
    new_fields = {f.number: f for f in new.field}
    for f in old.field:
        where = f"{name}.{f.name} = {f.number}"
        g = new_fields.get(f.number)
        if g is None:
            if not _reserved(new.reserved_range, f.number, end_inclusive=False):
                problems.append(f"{where}: removed without `reserved {f.number}`")
            continue
        if g.name != f.name:
            problems.append(f"{where}: renamed to {g.name!r}")
        if _type(g) != _type(f):
            problems.append(f"{where}: type {_type(f)} -> {_type(g)}")
        if g.label != f.label:
            problems.append(f"{where}: label {FieldDescriptorProto.Label.Name(f.label)} -> "
                            f"{FieldDescriptorProto.Label.Name(g.label)}")
        if g.proto3_optional != f.proto3_optional:
            problems.append(f"{where}: `optional` {'removed' if f.proto3_optional else 'added'}")
        if _oneof(new, g) != _oneof(old, f):
            problems.append(f"{where}: oneof {_oneof(old, f)!r} -> {_oneof(new, g)!r}")
    old_numbers = {f.number for f in old.field}
    for g in new.field:
        if g.number not in old_numbers and _reserved(old.reserved_range, g.number, end_inclusive=False):
            problems.append(f"{name}.{g.name} = {g.number}: reuses a reserved number")
        if g.name in old.reserved_name:
            problems.append(f"{name}.{g.name} = {g.number}: reuses a reserved name")
    return problems


def _check_enum(name: str, old: EnumDescriptorProto, new: EnumDescriptorProto) -> list[str]:
    problems = []
    new_values = {v.number: v for v in new.value}
    for v in old.value:
        w = new_values.get(v.number)
        if w is None:
            if not _reserved(new.reserved_range, v.number, end_inclusive=True):
                problems.append(f"{name}.{v.name} = {v.number}: removed without `reserved {v.number}`")
        elif w.name != v.name:
            problems.append(f"{name}.{v.name} = {v.number}: renamed to {w.name!r}")
    old_numbers = {v.number for v in old.value}
    for w in new.value:
        if w.number not in old_numbers and _reserved(old.reserved_range, w.number, end_inclusive=True):
            problems.append(f"{name}.{w.name} = {w.number}: reuses a reserved number")
        if w.name in old.reserved_name:
            problems.append(f"{name}.{w.name} = {w.number}: reuses a reserved name")
    return problems


def _check_service(name: str, old: ServiceDescriptorProto, new: ServiceDescriptorProto) -> list[str]:
    problems = []
    new_methods = {m.name: m for m in new.method}
    for m in old.method:
        n = new_methods.get(m.name)
        where = f"{name}.{m.name}"
        if n is None:
            problems.append(f"{where}: removed")
            continue
        if (n.input_type, n.output_type) != (m.input_type, m.output_type):
            problems.append(f"{where}: ({m.input_type}) -> ({m.output_type}) became "
                            f"({n.input_type}) -> ({n.output_type})")
        if (n.client_streaming, n.server_streaming) != (m.client_streaming, m.server_streaming):
            problems.append(f"{where}: streaming (client, server) {(m.client_streaming, m.server_streaming)} -> "
                            f"{(n.client_streaming, n.server_streaming)}")
    return problems


def check(golden: FileDescriptorSet, current: FileDescriptorSet) -> list[str]:
    """Every incompatibility of `current` with `golden`, as readable lines (empty = compatible)."""
    old_m, old_e, old_s = _index(golden)
    new_m, new_e, new_s = _index(current)
    problems = []
    for kind, old, new, fn in (("message", old_m, new_m, _check_message), ("enum", old_e, new_e, _check_enum),
                               ("service", old_s, new_s, _check_service)):
        for name, desc in old.items():
            if name not in new:
                problems.append(f"{kind} {name}: removed")
            else:
                problems += fn(name, desc, new[name])
    return problems


def load(path: str) -> FileDescriptorSet:
    with open(path, "rb") as f:
        return FileDescriptorSet.FromString(f.read())


def loaded_descriptor_set(package: str = "cde.rpc.v1") -> FileDescriptorSet:
    """The descriptor set of the generated modules as imported (dependencies first)."""
    pkg = importlib.import_module(package)
    files = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.endswith("_pb2"):
            d = importlib.import_module(f"{package}.{info.name}").DESCRIPTOR
            files[d.name] = d
    out, done = FileDescriptorSet(), set()

    def add(d) -> None:
        if d.name in done:
            return
        done.add(d.name)
        for dep in d.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        d.CopyToProto(proto)
        out.file.append(proto)

    for name in sorted(files):
        add(files[name])
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m cde.rpc.compat GOLDEN.binpb CURRENT.binpb", file=sys.stderr)
        return 2
    problems = check(load(argv[0]), load(argv[1]))
    for p in problems:
        print(f"incompatible: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
