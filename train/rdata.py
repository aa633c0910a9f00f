"""A minimal reader of R's lazy-load databases (`data/Rdata.rdx` + `Rdata.rdb`), enough for
character vectors and data frames of them (janeaustenr's novels). No R, no pickle: R's XDR
serialization format is parsed field by field, and anything unexpected is an error.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Any

NILVALUE, SYM, LIST, CLOS, ENV, PROM, LANG = 254, 1, 2, 3, 4, 5, 6
CHAR, LGL, INT, REAL, CPLX, STR, VEC = 9, 10, 13, 14, 15, 16, 19
REF, GLOBALENV, EMPTYENV, BASEENV, MISSINGARG, BASENAMESPACE = 255, 253, 242, 241, 251, 247


class _Reader:
    def __init__(self, data: bytes):
        self.d, self.p, self.refs = data, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def bytes(self, n: int) -> bytes:
        b = self.d[self.p:self.p + n]
        if len(b) != n:
            raise ValueError("truncated R serialization")
        self.p += n
        return b

    def header(self) -> None:
        if self.bytes(2) != b"X\n":
            raise ValueError("not an XDR R serialization")
        version = self.int()
        self.int(), self.int()
        if version == 3:
            self.bytes(self.int())  # native encoding name

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (NILVALUE, GLOBALENV, EMPTYENV, BASEENV, MISSINGARG, BASENAMESPACE):
            return None
        if kind == REF:
            return self.refs[(flags >> 8) - 1]
        if kind == SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind in (LIST, LANG):
            out: dict[Any, Any] = {}
            attrs = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            out[tag if tag is not None else len(out)] = self.item()
            rest = self.item()
            if isinstance(rest, dict):
                for k, v in rest.items():
                    out[k if not isinstance(k, int) else len(out)] = v
            del attrs
            return out
        if kind == CHAR:
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("utf-8" if flags & (1 << 15) else "latin-1"
                                                              if flags & (1 << 14) else "utf-8", "replace")
        if kind in (LGL, INT):
            n = self.int()
            vals = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif kind == REAL:
            n = self.int()
            vals = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif kind == STR:
            vals = [self.item() for _ in range(self.int())]
        elif kind == VEC:
            vals = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"unsupported R object type {kind}")
        attrs = self.item() if has_attr else None
        if isinstance(attrs, dict) and "names" in attrs and kind == VEC:
            return dict(zip(attrs["names"], vals))
        return vals


def unserialize(data: bytes) -> Any:
    r = _Reader(data)
    r.header()
    return r.item()


def read_lazyload(rdx: str | Path) -> dict[str, Any]:
    """name -> object of every variable in a lazy-load database (`X.rdx` beside `X.rdb`)."""
    rdx = Path(rdx)
    index = unserialize(gzip.decompress(rdx.read_bytes()) if rdx.read_bytes()[:2] == b"\x1f\x8b"
                        else zlib.decompress(rdx.read_bytes()[4:]))
    rdb = rdx.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[int(offset):int(offset) + int(length)]
        out[name] = unserialize(zlib.decompress(blob[4:]))
    return out
