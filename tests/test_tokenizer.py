"""Tokenizer tests: offline, fast.  A synthetic tiktoken BPE file stands in for
cl100k_base; the real file is used only if CDE_CL100K_BPE points at it."""

from __future__ import annotations

import base64
import importlib.util
import os
from pathlib import Path

import pytest

from cde.steerling.tokenizer import (
    BPE_ENV_VAR,
    CL100K_PAT_STR,
    CL100K_SHA256,
    ByteTokenizer,
    Cl100kTokenizer,
    Tokenizer,
    load_tokenizer,
)

# Read before any test unsets it (see the autouse fixture).
REAL_BPE = os.environ.get(BPE_ENV_VAR)

MERGES = [b" t", b"he", b" the", b"ab", b"abc"]  # ranks 256..260
N = 256 + len(MERGES)  # max rank + 1 = 261
# The reference's layout rule applied to the synthetic file.
SYNTH = {
    "<|endoftext|>": N + 1,
    "<|fim_prefix|>": N + 2,
    "<|fim_middle|>": N + 3,
    "<|fim_suffix|>": N + 4,
    "<|endofprompt|>": N + 20,
}
BASE = N + 21  # == tiktoken n_vocab of the synthetic base encoding

TEXTS = [
    "",
    "hello world",
    "the cat and the abc abcabc",
    "  leading and trailing  \n\n\ttabs\r\n",
    "naïve café — Ünïcödé, 日本語, Ελληνικά",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧",
    "12345678 numbers's it'll",
]
SPECIAL_SPELLINGS = [
    "<|mask|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<|pad|><|bos|><|endofchunk|>",
    "<|start_header_id|>user<|end_header_id|>",
    "<|fim_prefix|><|endofprompt|>",
    "x<|mask|>y <|eot_id|>\n<|endoftext|>",
]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BPE_ENV_VAR, raising=False)


def write_bpe(path: Path, tokens: list[bytes]) -> Path:
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(tokens)))
    return path


@pytest.fixture
def bpe_file(tmp_path: Path) -> Path:
    return write_bpe(tmp_path / "cl100k_base.tiktoken", [bytes([b]) for b in range(256)] + MERGES)


@pytest.fixture
def cl100k(bpe_file: Path) -> Cl100kTokenizer:
    return Cl100kTokenizer(bpe_file)


@pytest.fixture(params=["byte", "cl100k"])
def tok(request: pytest.FixtureRequest, bpe_file: Path) -> Tokenizer:
    return ByteTokenizer() if request.param == "byte" else Cl100kTokenizer(bpe_file)


# ---------------------------------------------------------------- both kinds


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size and i not in tok.special_ids for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("text", SPECIAL_SPELLINGS)
def test_special_spellings_are_plain_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == text


def test_special_ids_and_stops(tok: Tokenizer) -> None:
    ids = [tok.eos_id, tok.pad_id, tok.bos_id, tok.endofchunk_id, tok.mask_id]
    ids += [tok.start_header_id, tok.end_header_id, tok.eot_id]
    assert all(isinstance(i, int) for i in ids)
    assert len(set(ids)) == len(ids)
    assert set(ids) <= tok.special_ids
    assert max(tok.special_ids) == tok.vocab_size - 1
    assert tok.stop_ids == {tok.eos_id, tok.eot_id}
    assert tok.instruct and tok.name


def test_decode_specials(tok: Tokenizer) -> None:
    ids = [tok.bos_id] + tok.encode("hi") + [tok.mask_id, tok.eot_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode_bytes(ids) == b"hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|>hi<|mask|><|eot_id|>"
    assert tok.token_bytes(tok.eos_id) == b"<|endoftext|>"


def test_incremental_utf8(tok: Tokenizer) -> None:
    text = "a😀é"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # no merges cover these bytes
    # A prefix that cuts the emoji: bytes are exact, text gets U+FFFD.
    assert tok.decode_bytes(ids[:3]) == text.encode("utf-8")[:3]
    assert tok.decode(ids[:3]) == "a\ufffd"


def test_invalid_ids(tok: Tokenizer) -> None:
    for bad in (-1, tok.vocab_size, 10**6):
        with pytest.raises(ValueError):
            tok.decode([bad])
        with pytest.raises(ValueError):
            tok.token_bytes(bad)


def test_lone_surrogate_is_replaced(tok: Tokenizer) -> None:
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say <|eot_id|> please"},
    ]
    ids = tok.apply_chat_template(msgs)
    sh, eh, eot = tok.start_header_id, tok.end_header_id, tok.eot_id
    expected: list[int] = []
    for m in msgs:
        expected += [sh, *tok.encode(m["role"]), eh, *tok.encode("\n\n" + m["content"]), eot]
    tail = [sh, *tok.encode("assistant"), eh, *tok.encode("\n\n")]
    assert ids == expected + tail
    assert ids[0] == sh and ids.count(eot) == 2 and ids.count(sh) == 3
    assert ids[-1 - len(tok.encode("\n\n")) :] == [eh, *tok.encode("\n\n")]
    assert ids[-1] not in tok.special_ids
    assert tok.bos_id not in ids
    assert tok.decode(ids) == "system\n\nBe brief.user\n\nSay <|eot_id|> pleaseassistant\n\n"
    # the literal "<|eot_id|>" in content did not become a real eot
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected
    assert tok.apply_chat_template([], add_generation_prompt=False) == []


@pytest.mark.parametrize(
    "msgs",
    [
        [{"role": "tool", "content": "x"}],
        [{"role": "User", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        ["user: hi"],
    ],
)
def test_chat_template_rejects(tok: Tokenizer, msgs: list) -> None:
    with pytest.raises(ValueError):
        tok.apply_chat_template(msgs)


# ---------------------------------------------------------------- byte


def test_byte_layout() -> None:
    t = ByteTokenizer()
    assert (t.eos_id, t.pad_id, t.bos_id, t.endofchunk_id, t.mask_id) == (256, 257, 258, 259, 260)
    assert (t.start_header_id, t.end_header_id, t.eot_id) == (261, 262, 263)
    assert t.vocab_size == 264
    assert t.special_ids == frozenset(range(256, 264))
    assert t.encode("Aé") == [65, 0xC3, 0xA9]


# ---------------------------------------------------------------- cl100k


def test_cl100k_layout_follows_formula(bpe_file: Path) -> None:
    t = Cl100kTokenizer(bpe_file, instruct=True)
    assert t.eos_id == N + 1
    assert (t.pad_id, t.bos_id, t.endofchunk_id, t.mask_id) == (BASE, BASE + 1, BASE + 2, BASE + 3)
    assert (t.start_header_id, t.end_header_id, t.eot_id) == (BASE + 4, BASE + 5, BASE + 6)
    assert t.vocab_size == BASE + 7
    assert t.special_ids == frozenset(SYNTH.values()) | frozenset(range(BASE, BASE + 7))

    b = Cl100kTokenizer(bpe_file, instruct=False)
    assert (b.pad_id, b.mask_id, b.vocab_size) == (BASE, BASE + 3, BASE + 4)
    assert b.start_header_id is b.end_header_id is b.eot_id is None
    assert b.stop_ids == {b.eos_id} and not b.instruct
    with pytest.raises(ValueError):
        b.apply_chat_template([{"role": "user", "content": "hi"}])


def test_cl100k_merges_apply(cl100k: Cl100kTokenizer) -> None:
    assert cl100k.encode(" the") == [258]
    assert cl100k.encode("abc") == [260]
    assert cl100k.encode("ab") == [259]


def test_cl100k_unassigned_gap_id_rejected(cl100k: Cl100kTokenizer) -> None:
    with pytest.raises(ValueError, match="not assigned"):
        cl100k.decode([N])  # the gap right after the ranks, like 100256


def test_pattern_is_tiktokens() -> None:
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    assert spec is not None and spec.origin
    assert CL100K_PAT_STR in Path(spec.origin).read_text()


def test_missing_file_message(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "cl100k_base.tiktoken"
    with pytest.raises(FileNotFoundError) as ei:
        Cl100kTokenizer(missing)
    msg = str(ei.value)
    assert str(missing) in msg and BPE_ENV_VAR in msg and "Nothing is downloaded" in msg
    assert "model directory" in msg


def test_malformed_bpe(tmp_path: Path) -> None:
    p = tmp_path / "bad.tiktoken"
    p.write_bytes(b"not-base64!! 0\n")
    with pytest.raises(ValueError):
        Cl100kTokenizer(p)
    short = write_bpe(tmp_path / "short.tiktoken", [bytes([b]) for b in range(200)])
    with pytest.raises(ValueError, match="single-byte"):
        Cl100kTokenizer(short)


def test_sha256_check(bpe_file: Path) -> None:
    with pytest.raises(ValueError, match="sha256"):
        Cl100kTokenizer(bpe_file, expected_sha256=CL100K_SHA256)


# ---------------------------------------------------------------- factory


def test_load_tokenizer(tmp_path: Path, bpe_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(load_tokenizer({"kind": "byte"}, None), ByteTokenizer)

    t = load_tokenizer({"kind": "cl100k", "bpe_file": "cl100k_base.tiktoken", "instruct": True}, tmp_path)
    assert isinstance(t, Cl100kTokenizer) and t.path == bpe_file and t.eot_id == BASE + 6
    t = load_tokenizer({"kind": "cl100k", "instruct": False}, tmp_path)
    assert t.eot_id is None

    other = tmp_path / "elsewhere"
    other.mkdir()
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        load_tokenizer({"kind": "cl100k"}, other)
    monkeypatch.setenv(BPE_ENV_VAR, str(bpe_file))
    assert load_tokenizer({"kind": "cl100k"}, other).path == bpe_file  # env wins

    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        load_tokenizer({"kind": "sentencepiece"}, tmp_path)
    with pytest.raises(ValueError):
        load_tokenizer({}, tmp_path)
    with pytest.raises(ValueError, match="instuct"):
        load_tokenizer({"kind": "cl100k", "instuct": False}, tmp_path)
    with pytest.raises(ValueError):
        load_tokenizer({"kind": "cl100k", "instruct": "yes"}, tmp_path)


# ---------------------------------------------------------------- parity with steerling


def _reference(monkeypatch: pytest.MonkeyPatch, path: Path, specials: dict[str, int], instruct: bool):
    """steerling's SteerlingTokenizer, with get_encoding served from a local file."""
    ref_mod = pytest.importorskip("steerling.data.tokenizer")
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # keep load_tiktoken_bpe from caching
    base = tiktoken.Encoding(
        name="cl100k_base",
        pat_str=CL100K_PAT_STR,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens=specials,
    )
    monkeypatch.setattr(ref_mod.tiktoken, "get_encoding", lambda name: base)
    return ref_mod.SteerlingTokenizer(instruct=instruct)


def _check_parity(ours: Cl100kTokenizer, ref) -> None:
    for attr, ref_attr in [
        ("vocab_size", "vocab_size"),
        ("eos_id", "eos_token_id"),
        ("pad_id", "pad_token_id"),
        ("bos_id", "bos_token_id"),
        ("endofchunk_id", "endofchunk_token_id"),
        ("mask_id", "mask_token_id"),
        ("start_header_id", "start_header_id"),
        ("end_header_id", "end_header_id"),
        ("eot_id", "eot_id"),
    ]:
        assert getattr(ours, attr) == getattr(ref, ref_attr), attr
    for text in TEXTS + SPECIAL_SPELLINGS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids)


@pytest.mark.parity
@pytest.mark.parametrize("instruct", [True, False])
def test_parity_synthetic(
    bpe_file: Path, monkeypatch: pytest.MonkeyPatch, instruct: bool
) -> None:
    ref = _reference(monkeypatch, bpe_file, SYNTH, instruct)
    _check_parity(Cl100kTokenizer(bpe_file, instruct=instruct), ref)


@pytest.mark.parity
@pytest.mark.skipif(not (REAL_BPE and Path(REAL_BPE).is_file()), reason=f"{BPE_ENV_VAR} not set to a file")
def test_real_cl100k(monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(REAL_BPE or "")
    t = Cl100kTokenizer(path, instruct=True, expected_sha256=CL100K_SHA256)
    assert (t.eos_id, t.pad_id, t.bos_id, t.endofchunk_id, t.mask_id) == (100257, 100277, 100278, 100279, 100280)
    assert (t.start_header_id, t.end_header_id, t.eot_id) == (100281, 100282, 100283)
    assert t.vocab_size == 100284
    assert t.encode("hello world") == [15339, 1917]
    assert t.encode("<|endoftext|>") != [100257]
    official = {
        "<|endoftext|>": 100257,
        "<|fim_prefix|>": 100258,
        "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260,
        "<|endofprompt|>": 100276,
    }
    _check_parity(t, _reference(monkeypatch, path, official, instruct=True))
