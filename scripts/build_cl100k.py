#!/usr/bin/env python3
"""Write ``cl100k_base.tiktoken`` (the BPE file Steerling's tokenizer reads) from the npm package
``js-tiktoken`` (MIT), which carries cl100k_base's ranks, and check its sha256 against the one
``cde.steerling.tokenizer`` expects. Prints the file's path on stdout.

    python scripts/build_cl100k.py                        # npm pack js-tiktoken@PINNED, write to the cache
    python scripts/build_cl100k.py --out DIR/cl100k_base.tiktoken
    python scripts/build_cl100k.py --tarball js-tiktoken-1.0.21.tgz --out FILE   # offline: a tarball
                                                          # made elsewhere with `npm pack js-tiktoken@1.0.21`

Default output: ``$CDE_CACHE_DIR`` or ``~/.cache/cde``, then ``cl100k_base.tiktoken``; an existing
file with the right sha256 is kept. The tarball must match the pinned npm integrity (sha512).
The package's JavaScript is never run: ``dist/ranks/cl100k_base.js`` is
``export default {...}`` with a JSON object whose ``bpe_ranks`` string holds lines of
``<marker> <first rank> <base64 token> <base64 token> ...`` (consecutive ranks), which we parse.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: cde/ is importable from the repo root

from cde.steerling.tokenizer import CL100K_SHA256  # noqa: E402

JS_TIKTOKEN_VERSION = "1.0.21"
# `npm view js-tiktoken@1.0.21 dist.integrity`
JS_TIKTOKEN_INTEGRITY = "sha512-biOj/6M5qdgx5TKjDnFT1ymSpM5tbd3ylwDtrQvFQSu0Z7bBYko2dF+W/aUkXUPuk6IVpRxk/3Q2sHOzGlS36g=="
RANKS_MEMBER = "package/dist/ranks/cl100k_base.js"
JS_PREFIX = "export default "
MAX_RANKS_BYTES = 16 << 20   # the real member is ~1.1 MB; refuse anything wildly larger
FILE_NAME = "cl100k_base.tiktoken"


class BuildError(Exception):
    """The package or its ranks are not what this script expects."""


def default_out() -> Path:
    cache = os.environ.get("CDE_CACHE_DIR") or Path.home() / ".cache" / "cde"
    return Path(cache) / FILE_NAME


def npm_integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def npm_pack(dest: Path, version: str = JS_TIKTOKEN_VERSION) -> Path:
    """``npm pack`` downloads the package tarball through npm's own client (and its cache)."""
    try:
        out = subprocess.run(["npm", "pack", f"js-tiktoken@{version}", "--pack-destination", str(dest), "--json"],
                             capture_output=True, text=True, timeout=300, check=True).stdout
    except FileNotFoundError as e:
        raise BuildError("npm not found: install Node.js/npm, or pass --tarball (see --help)") from e
    except subprocess.CalledProcessError as e:
        raise BuildError(f"npm pack js-tiktoken@{version} failed:\n{e.stderr.strip()[-2000:]}") from e
    return dest / json.loads(out)[0]["filename"]


def read_ranks_js(tarball: Path, integrity: str = JS_TIKTOKEN_INTEGRITY) -> str:
    """The text of dist/ranks/cl100k_base.js from a verified package tarball (nothing extracted to disk)."""
    data = tarball.read_bytes()
    if integrity and npm_integrity(data) != integrity:
        raise BuildError(f"{tarball}: integrity {npm_integrity(data)} is not the pinned js-tiktoken@"
                         f"{JS_TIKTOKEN_VERSION} ({integrity})")
    with tarfile.open(tarball, "r:gz") as tar:
        try:
            member = tar.getmember(RANKS_MEMBER)
        except KeyError as e:
            raise BuildError(f"{tarball}: no {RANKS_MEMBER}") from e
        if not member.isfile() or member.size > MAX_RANKS_BYTES:
            raise BuildError(f"{tarball}: {RANKS_MEMBER} is not a regular file under {MAX_RANKS_BYTES} bytes")
        return tar.extractfile(member).read().decode("utf-8")


def parse_ranks(js: str) -> list[bytes]:
    """Tokens in rank order (index = rank) from js-tiktoken's ranks module text."""
    text = js.strip()
    if not text.startswith(JS_PREFIX):
        raise BuildError(f"ranks module does not start with {JS_PREFIX!r}")
    try:
        obj = json.loads(text[len(JS_PREFIX):].rstrip(";"))
        compressed = obj["bpe_ranks"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BuildError(f"ranks module is not `export default` of a JSON object with bpe_ranks: {e}") from e
    if not isinstance(compressed, str):
        raise BuildError("bpe_ranks is not a string")
    by_rank: dict[int, bytes] = {}
    for n, line in enumerate(compressed.split("\n"), 1):
        if not line:
            continue
        fields = line.split(" ")
        if len(fields) < 2 or not fields[1].isdigit():
            raise BuildError(f"bpe_ranks line {n}: expected '<marker> <first rank> tokens...'")
        first = int(fields[1])
        for i, b64 in enumerate(fields[2:]):
            try:
                token = base64.b64decode(b64, validate=True)
            except binascii.Error as e:
                raise BuildError(f"bpe_ranks line {n}: {b64[:40]!r} is not base64") from e
            if first + i in by_rank:
                raise BuildError(f"bpe_ranks line {n}: rank {first + i} given twice")
            by_rank[first + i] = token
    if sorted(by_rank) != list(range(len(by_rank))):
        raise BuildError("ranks are not 0..n-1 without gaps")
    tokens = [by_rank[r] for r in range(len(by_rank))]
    if len(set(tokens)) != len(tokens):
        raise BuildError("a token appears under two ranks")
    return tokens


def tiktoken_file_bytes(tokens: list[bytes]) -> bytes:
    """tiktoken's BPE file format: ``base64(token) rank`` per line, in rank order."""
    return b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens))


def build(out: Path, tarball: Path | None = None, expected_sha256: str | None = CL100K_SHA256,
          integrity: str = JS_TIKTOKEN_INTEGRITY) -> Path:
    """Write the BPE file to ``out`` (atomically) unless it is already there with the expected sha256."""
    if expected_sha256 and out.is_file() and hashlib.sha256(out.read_bytes()).hexdigest() == expected_sha256:
        return out
    with tempfile.TemporaryDirectory(prefix="cde-cl100k-") as tmp:
        source = tarball if tarball is not None else npm_pack(Path(tmp))
        data = tiktoken_file_bytes(parse_ranks(read_ranks_js(source, integrity)))
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha256 and actual != expected_sha256:
        raise BuildError(f"built file has sha256 {actual}, the tokenizer expects {expected_sha256}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + f".{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"output file (default {default_out()})")
    ap.add_argument("--tarball", type=Path, default=None,
                    help=f"js-tiktoken-{JS_TIKTOKEN_VERSION}.tgz made by `npm pack` (default: run npm pack here)")
    args = ap.parse_args(argv)
    try:
        path = build(args.out or default_out(), args.tarball)
    except (BuildError, OSError) as e:
        print(f"build_cl100k: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
