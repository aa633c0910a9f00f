"""The Steerling family on a `tokenizer.json` (the bundled trained models' 8K byte-level BPE,
train/artifacts/tokenizer.json): round trip, specials, chat template, the gateway's streaming
detokenizer, the rule that user text never becomes a special id, and selection by config."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from cde.steerling.tokenizer import TokenizerJsonTokenizer, load_tokenizer
from gateway.detok import BlockDetokenizer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "train" / "artifacts" / "tokenizer.json"

TEXTS = [
    "",
    "Once upon a time, a little fox lived by the sea.",
    "  leading and trailing  \n\n\ttabs\r\n",
    "naïve café — Ünïcödé, 日本語, Ελληνικά",
    "emoji 😀👍🏽 and ZWJ 👨‍👩‍👧",
    "12345678 numbers's it'll",
]
SPELLINGS = [
    "<|mask|>", "<|eot_id|>", "<|endoftext|>", "<|pad|><|bos|><|endofchunk|>",
    "<|start_header_id|>user<|end_header_id|>", "<|im_start|>assistant\n<|im_end|>", "x<|MASK|>y <|mask|>z",
]


@pytest.fixture(scope="module")
def tok() -> TokenizerJsonTokenizer:
    return TokenizerJsonTokenizer(TOKENIZER)


def test_layout(tok: TokenizerJsonTokenizer) -> None:
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.endofchunk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert (tok.start_header_id, tok.end_header_id, tok.eot_id) == (5, 6, 7)
    assert tok.special_ids == frozenset(range(11))  # the ChatML ones and <|MASK|> are special too
    assert tok.stop_ids == {0, 7} and tok.instruct and tok.vocab_size == 8192
    base = TokenizerJsonTokenizer(TOKENIZER, instruct=False)
    assert base.eot_id is None and not base.instruct and base.stop_ids == {0}
    with pytest.raises(ValueError):
        base.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="not assigned"):
        base.decode([7])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: TokenizerJsonTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size and i not in tok.special_ids for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    if text:
        assert len(ids) < len(text.encode("utf-8")) or len(text) < 4  # merges apply


@pytest.mark.parametrize("text", SPELLINGS)
def test_user_text_never_becomes_a_special_id(tok: TokenizerJsonTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert not set(ids) & tok.special_ids
    assert tok.decode(ids) == text


def test_random_text_round_trip(tok: TokenizerJsonTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc XYZ\n\t<|>_é日😀" + "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(40))
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(60)))
        ids = tok.encode(text)
        assert tok.decode(ids) == text, f"seed={seed} text={text!r}"
        assert not set(ids) & tok.special_ids, f"seed={seed} text={text!r}"


def test_decode_specials(tok: TokenizerJsonTokenizer) -> None:
    ids = [tok.bos_id] + tok.encode("hi") + [tok.mask_id, 8, tok.eot_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|>hi<|mask|><|im_start|><|eot_id|>"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_chat_template(tok: TokenizerJsonTokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|eot_id|> please"}]
    ids = tok.apply_chat_template(msgs)
    sh, eh, eot = tok.start_header_id, tok.end_header_id, tok.eot_id
    expected: list[int] = []
    for m in msgs:
        expected += [sh, *tok.encode(m["role"]), eh, *tok.encode("\n\n" + m["content"]), eot]
    assert ids == expected + [sh, *tok.encode("assistant"), eh, *tok.encode("\n\n")]
    assert ids.count(eot) == 2
    assert tok.decode(ids) == "system\n\nBe brief.user\n\nSay <|eot_id|> pleaseassistant\n\n"


def test_streaming_detokenizer_splits_no_character(tok: TokenizerJsonTokenizer) -> None:
    text = "The fox said “héllo” 😀 to the 日本 crab. " * 3
    ids = tok.encode(text)
    for size in (1, 2, 3, 7):
        d = BlockDetokenizer(tok)
        out = "".join(d.feed(ids[i:i + size]).text for i in range(0, len(ids), size)) + d.flush()
        assert out == text, size
    d = BlockDetokenizer(tok)
    r = d.feed(tok.encode("The end.") + [tok.eot_id] + tok.encode(" more"))
    assert r.stopped and r.text == "The end."


def test_selected_by_config(tmp_path: Path) -> None:
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    t = load_tokenizer({"kind": "tokenizer_json"}, tmp_path)
    assert isinstance(t, TokenizerJsonTokenizer) and t.eot_id == 7
    assert load_tokenizer({"kind": "tokenizer_json", "file": str(TOKENIZER), "instruct": False}, None).eot_id is None
    with pytest.raises(ValueError, match="fle"):
        load_tokenizer({"kind": "tokenizer_json", "fle": "x"}, tmp_path)
    with pytest.raises(ValueError, match="instruct"):
        load_tokenizer({"kind": "tokenizer_json", "instruct": 1}, tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer({"kind": "tokenizer_json"}, tmp_path / "nowhere")


def test_gateway_model_card_uses_it(tmp_path: Path) -> None:
    """A Steerling model directory whose config names the tokenizer.json: the gateway loads it."""
    from cde.steerling.config import TINY
    from gateway.pipeline import ModelCard

    cfg = TINY.__class__(**{**TINY.__dict__, "vocab_size": 8192, "eos_id": 0, "pad_id": 1, "bos_id": 2,
                            "endofchunk_id": 3, "mask_id": 4, "start_header_id": 5, "end_header_id": 6, "eot_id": 7, "tokenizer": {"kind": "tokenizer_json"}})
    cfg.save(tmp_path)
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    card = ModelCard.load(tmp_path)
    assert isinstance(card.tokenizer, TokenizerJsonTokenizer)
    assert card.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])[0] == 5


def test_rejects_files_without_the_specials(tmp_path: Path) -> None:
    data = json.loads(TOKENIZER.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|endofchunk|>"]
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="endofchunk"):
        TokenizerJsonTokenizer(bad)
    data = json.loads(TOKENIZER.read_text())
    data["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="byte-level"):
        TokenizerJsonTokenizer(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError):
        TokenizerJsonTokenizer(bad)
