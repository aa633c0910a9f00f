"""scripts/build_cl100k.py: js-tiktoken's ranks module -> tiktoken's BPE file.

The synthetic tests pin the format both ways (tiktoken's own loader reads what we write); the
real file (built by scripts/test.sh into CDE_CL100K_BPE, sha256-checked there) is checked
against tiktoken's loader and the tokenizer's expected digest here and in test_tokenizer.py."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from tiktoken.load import load_tiktoken_bpe

from cde.launch import ROOT
from cde.steerling.tokenizer import BPE_ENV_VAR, CL100K_SHA256

spec = importlib.util.spec_from_file_location("build_cl100k", ROOT / "scripts" / "build_cl100k.py")
build_cl100k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_cl100k)

REAL_BPE = os.environ.get(BPE_ENV_VAR)


def ranks_js(lines: list[str]) -> str:
    obj = {"pat_str": "x", "special_tokens": {"<|endoftext|>": 9}, "bpe_ranks": "\n".join(lines)}
    return build_cl100k.JS_PREFIX + json.dumps(obj)


def b64(s: bytes) -> str:
    return base64.b64encode(s).decode()


def make_tarball(path: Path, js: str, member: str = build_cl100k.RANKS_MEMBER) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        data = js.encode()
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def test_parse_ranks_lines_with_offsets():
    tokens = [b"a", b"b", b" the", b"\xff\x00", b"zz"]
    js = ranks_js([f"! 0 {b64(tokens[0])} {b64(tokens[1])}",
                   f"! 2 {' '.join(b64(t) for t in tokens[2:])}", ""])
    assert build_cl100k.parse_ranks(js) == tokens


def test_written_file_reads_back_with_tiktoken(tmp_path):
    tokens = [bytes([i]) for i in range(256)] + [b" t", b"he"]
    js = ranks_js([f"! 0 {' '.join(b64(t) for t in tokens)}"])
    tarball = make_tarball(tmp_path / "pkg.tgz", js)
    out = build_cl100k.build(tmp_path / "out" / "bpe.tiktoken", tarball, expected_sha256=None, integrity="")
    assert load_tiktoken_bpe(str(out)) == {t: r for r, t in enumerate(tokens)}
    assert out.read_bytes().splitlines()[256] == base64.b64encode(b" t") + b" 256"


@pytest.mark.parametrize("js, message", [
    ("module.exports = {}", "does not start with"),
    (build_cl100k.JS_PREFIX + "{not json", "JSON object"),
    (ranks_js(["! 0 YQ== Yg==", "! 1 Yw=="]), "rank 1 given twice"),
    (ranks_js(["! 0 YQ==", "! 2 Yw=="]), "without gaps"),
    (ranks_js(["! 0 YQ== YQ=="]), "two ranks"),
    (ranks_js(["! 0 Y!Q=="]), "not base64"),
    (ranks_js(["! x YQ=="]), "first rank"),
])
def test_malformed_ranks_are_refused(js, message):
    with pytest.raises(build_cl100k.BuildError, match=message):
        build_cl100k.parse_ranks(js)


def test_tarball_integrity_and_digest_are_checked(tmp_path):
    tarball = make_tarball(tmp_path / "pkg.tgz", ranks_js([f"! 0 {b64(b'a')}"]))
    out = tmp_path / "bpe.tiktoken"
    with pytest.raises(build_cl100k.BuildError, match="integrity"):
        build_cl100k.build(out, tarball)  # the pinned js-tiktoken integrity
    with pytest.raises(build_cl100k.BuildError, match="sha256"):
        build_cl100k.build(out, tarball, integrity=build_cl100k.npm_integrity(tarball.read_bytes()))
    assert not out.exists()
    other = make_tarball(tmp_path / "other.tgz", "x", member="package/README.md")
    with pytest.raises(build_cl100k.BuildError, match="no package/dist/ranks"):
        build_cl100k.build(out, other, integrity="")


@pytest.mark.parity
@pytest.mark.skipif(not (REAL_BPE and Path(REAL_BPE).is_file()), reason=f"{BPE_ENV_VAR} not set to a file "
                    "(scripts/test.sh builds it with scripts/build_cl100k.py)")
def test_real_file_matches_the_official_digest_and_loader():
    data = Path(REAL_BPE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == CL100K_SHA256
    ranks = load_tiktoken_bpe(REAL_BPE, expected_hash=CL100K_SHA256)
    assert len(ranks) == 100256 and ranks[b"hello"] == 15339


def test_dockerfile_builds_the_file_from_the_pinned_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG JS_TIKTOKEN_VERSION={build_cl100k.JS_TIKTOKEN_VERSION}\n" in dockerfile
    assert "scripts/build_cl100k.py --tarball" in dockerfile
    assert "ENV CDE_CL100K_BPE=/opt/cde/cl100k_base.tiktoken" in dockerfile
