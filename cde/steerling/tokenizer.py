"""Tokenizers for Steerling models, usable without any network access.

Steerling-8B uses tiktoken ``cl100k_base`` plus its own special tokens (see
``steerling.data.tokenizer.SteerlingTokenizer``).  That reference calls
``tiktoken.get_encoding``, which downloads the BPE file; a server must not do
that at start-up, so :class:`Cl100kTokenizer` reads a local ``.tiktoken`` file
and embeds the split regex itself.  :class:`ByteTokenizer` is a dependency-free
byte-level tokenizer for the bundled tiny test model.

Both implement :class:`Tokenizer`, so the rest of the server never needs to
know which one it holds.  Two rules hold for every implementation:

* ``encode`` never produces a special id, even when the text literally spells
  one (``"<|eot_id|>"``): user text must not be able to forge control tokens.
* Prompts are encoded without BOS/EOS, as the reference does for generation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tiktoken

from cde.byte_level import unicode_to_byte

if TYPE_CHECKING:
    from cde.steerling.config import SteerlingConfig

__all__ = [
    "BPE_ENV_VAR",
    "CL100K_PAT_STR",
    "CL100K_SHA256",
    "ByteTokenizer",
    "Cl100kTokenizer",
    "Tokenizer",
    "TokenizerJsonTokenizer",
    "check_special_ids",
    "load_model_tokenizer",
    "load_tokenizer",
]

#: Environment variable that overrides the location of the cl100k BPE file.
BPE_ENV_VAR = "CDE_CL100K_BPE"

#: Split regex of cl100k_base, copied verbatim from tiktoken_ext/openai_public.py
#: (tiktoken 0.14.0) so that nothing has to be fetched to build the encoding.
CL100K_PAT_STR = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""

#: SHA-256 of the official cl100k_base.tiktoken (as pinned by tiktoken).
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

# cl100k's own special tokens, as offsets from the end of the rank table
# (official file: ranks 0..100255, so <|endoftext|> = 100256 + 1 = 100257).
# Keeping offsets rather than absolute ids lets a tiny test BPE file reproduce
# the exact layout rule of the real one.
_CL100K_SPECIAL_OFFSETS = {
    "<|endoftext|>": 1,
    "<|fim_prefix|>": 2,
    "<|fim_middle|>": 3,
    "<|fim_suffix|>": 4,
    "<|endofprompt|>": 20,
}

_ROLES = ("system", "user", "assistant")


def _clean_surrogates(text: str) -> str:
    """Replace lone surrogates (which cannot be UTF-8 encoded) with U+FFFD,
    the same repair tiktoken applies, so both tokenizers agree."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Tokenizer(ABC):
    """Interface shared by all tokenizers the server can load.

    Attributes:
        name: short identifier, for logs and health endpoints.
        vocab_size: number of ids this tokenizer can produce (specials included;
            may contain unassigned gaps, and may be smaller than the model's
            padded embedding table).
        eos_id, pad_id, bos_id, endofchunk_id, mask_id: base special ids.
        start_header_id, end_header_id, eot_id: instruct chat ids, or None.
        special_ids: every id that is a special token; ``encode`` never emits
            these and ``decode(skip_special=True)`` drops them.
        stop_ids: ids that end generation: EOS, plus EOT when present.
    """

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int
    endofchunk_id: int
    mask_id: int
    start_header_id: int | None
    end_header_id: int | None
    eot_id: int | None
    special_ids: frozenset[int]
    stop_ids: frozenset[int]

    # id -> literal spelling of every special token; set by subclasses.
    _special_text: dict[int, str]

    def _init_specials(self, special_tokens: Mapping[str, int]) -> None:
        """Derive the special-id attributes from a spelling -> id map."""
        self._special_text = {i: s for s, i in special_tokens.items()}
        self.eos_id = special_tokens["<|endoftext|>"]
        self.pad_id = special_tokens["<|pad|>"]
        self.bos_id = special_tokens["<|bos|>"]
        self.endofchunk_id = special_tokens["<|endofchunk|>"]
        self.mask_id = special_tokens["<|mask|>"]
        self.start_header_id = special_tokens.get("<|start_header_id|>")
        self.end_header_id = special_tokens.get("<|end_header_id|>")
        self.eot_id = special_tokens.get("<|eot_id|>")
        self.special_ids = frozenset(self._special_text)
        stops = {self.eos_id}
        if self.eot_id is not None:
            stops.add(self.eot_id)
        self.stop_ids = frozenset(stops)

    def unassigned_ids(self) -> list[int]:
        """Ids below vocab_size that decode to nothing (neither a token nor a special): never to be
        sampled. Empty for tokenizers whose ids are dense."""
        return []

    @property
    def special_tokens(self) -> dict[str, int]:
        """Spelling -> id of every special token (a copy)."""
        return {s: i for i, s in self._special_text.items()}

    @property
    def instruct(self) -> bool:
        """True when the chat tokens exist, i.e. ``apply_chat_template`` works."""
        return self.eot_id is not None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Encode text as ordinary text: no BOS/EOS, never a special id."""

    @abstractmethod
    def _ordinary_bytes(self, ids: list[int]) -> bytes:
        """Bytes of non-special ids; ValueError for ids that are not assigned."""

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token; for a special token, its literal spelling."""
        token_id = int(token_id)
        if token_id in self._special_text:
            return self._special_text[token_id].encode("utf-8")
        return self._ordinary_bytes([token_id])

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of the non-special ids, specials dropped.

        Returned undecoded so a streaming detokenizer can hold back an
        incomplete UTF-8 sequence until the next token completes it.
        """
        return self._ordinary_bytes([i for i in map(int, ids) if i not in self._special_text])

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Decode ids to text; invalid UTF-8 becomes U+FFFD.

        With ``skip_special=False`` special tokens appear as their spelling.
        """
        ids = [int(i) for i in ids]
        if skip_special:
            data = self.decode_bytes(ids)
        else:
            parts: list[bytes] = []
            run: list[int] = []
            for i in ids:
                if i in self._special_text:
                    parts.append(self._ordinary_bytes(run))
                    run = []
                    parts.append(self._special_text[i].encode("utf-8"))
                else:
                    run.append(i)
            parts.append(self._ordinary_bytes(run))
            data = b"".join(parts)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat, in OUR Llama-3 style template.

        The public ``steerling`` package ships no chat template, so this one is
        ours, built from the instruct special tokens.  Per message::

            <|start_header_id|> role <|end_header_id|> "\\n\\n" + content <|eot_id|>

        and, with ``add_generation_prompt``, a trailing
        ``<|start_header_id|> assistant <|end_header_id|> "\\n\\n"`` so the model
        writes the assistant turn.  No BOS (prompts are encoded without it).
        Role and content go through :meth:`encode`, so content that spells a
        special token stays ordinary text.

        Raises:
            ValueError: tokenizer has no chat tokens; malformed message; role
                not one of system/user/assistant.
        """
        if self.start_header_id is None or self.end_header_id is None or self.eot_id is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat tokens (not an instruct tokenizer)")
        out: list[int] = []
        for n, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
                raise ValueError(f"message {n} must be a mapping with 'role' and 'content'")
            role, content = msg["role"], msg["content"]
            if role not in _ROLES:
                raise ValueError(f"message {n}: role must be one of {_ROLES}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"message {n}: content must be a string, got {type(content).__name__}")
            out.append(self.start_header_id)
            out += self.encode(role)
            out.append(self.end_header_id)
            out += self.encode("\n\n" + content)
            out.append(self.eot_id)
        if add_generation_prompt:
            out.append(self.start_header_id)
            out += self.encode("assistant")
            out.append(self.end_header_id)
            out += self.encode("\n\n")
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} vocab_size={self.vocab_size}>"


def _read_bpe_file(path: Path, expected_sha256: str | None) -> dict[bytes, int]:
    """Parse a tiktoken BPE file ("base64token rank" per line).

    Parsed here rather than with ``tiktoken.load.load_tiktoken_bpe`` because
    that helper also writes a copy into a temp-dir cache keyed by path, which
    can serve a stale file if the path is reused.
    """
    data = path.read_bytes()
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256.lower():
            raise ValueError(f"{path}: sha256 {actual} does not match expected {expected_sha256}")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except Exception as e:
            raise ValueError(f"{path}:{lineno}: malformed BPE line {line[:80]!r}") from e
    if not ranks:
        raise ValueError(f"{path}: BPE file is empty")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: duplicate ranks")
    if min(ranks.values()) < 0:
        raise ValueError(f"{path}: negative rank")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # Byte-level BPE needs every single byte, or some text is unencodable.
        raise ValueError(f"{path}: {len(missing)} single-byte tokens missing (e.g. byte {missing[0]})")
    return ranks


class Cl100kTokenizer(Tokenizer):
    """Steerling's tokenizer: cl100k_base from a local file + Steerling specials.

    Id layout mirrors ``SteerlingTokenizer``.  With ``n = max rank + 1``
    (100256 for the official file): cl100k's own specials keep their places
    (``<|endoftext|>`` n+1, fim prefix/middle/suffix n+2..n+4,
    ``<|endofprompt|>`` n+20); ``base = max id + 1`` (100277, tiktoken's
    ``n_vocab``); then pad=base, bos=base+1, endofchunk=base+2, mask=base+3,
    and if ``instruct`` start_header=base+4, end_header=base+5, eot=base+6.
    ``vocab_size`` is base+7 (instruct) or base+4.  Unlike the reference,
    the fim/endofprompt ids are also in ``special_ids``: the model has no use
    for them, and skipping them beats printing their spelling.
    """

    def __init__(
        self, bpe_file: str | Path, instruct: bool = True, expected_sha256: str | None = None
    ) -> None:
        path = Path(bpe_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"cl100k BPE file not found at {str(path)!r}. Nothing is downloaded: "
                f"set {BPE_ENV_VAR} to the path of cl100k_base.tiktoken, "
                f"or place cl100k_base.tiktoken in the model directory."
            )
        ranks = _read_bpe_file(path, expected_sha256)
        n = max(ranks.values()) + 1
        if len(ranks) != n:
            raise ValueError(f"{path}: the BPE ranks are not 0 .. {n - 1}")
        self._n_ranks = n
        special = {s: n + off for s, off in _CL100K_SPECIAL_OFFSETS.items()}
        base = max(special.values()) + 1
        extra = ["<|pad|>", "<|bos|>", "<|endofchunk|>", "<|mask|>"]
        if instruct:
            extra += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        special.update({s: base + k for k, s in enumerate(extra)})

        self.name = "cl100k_base_steerling" + ("_instruct" if instruct else "")
        self.vocab_size = base + len(extra)
        self.path = path
        self._enc = tiktoken.Encoding(
            name=self.name, pat_str=CL100K_PAT_STR, mergeable_ranks=ranks, special_tokens=special
        )
        self._init_specials(special)

    def encode(self, text: str) -> list[int]:
        # encode_ordinary treats special spellings as plain text.
        return self._enc.encode_ordinary(text)

    def _ordinary_bytes(self, ids: list[int]) -> bytes:
        if not ids:
            return b""
        bad = [i for i in ids if i in self._special_text]
        if bad:  # tiktoken would happily render their spelling; keep that explicit
            raise ValueError(f"special id {bad[0]} where ordinary ids were expected")
        try:
            return self._enc.decode_bytes(ids)
        except (KeyError, OverflowError):
            bad_id = next(i for i in ids if not self._is_rank(i))
            raise ValueError(f"token id {bad_id} is not assigned in {self.name}") from None

    def unassigned_ids(self) -> list[int]:
        """cl100k's holes among its own specials (n, n+5 .. n+19 for n = its 100,256 ranks)."""
        return [i for i in range(self._n_ranks, self.vocab_size) if i not in self._special_text and not self._is_rank(i)]

    def _is_rank(self, i: int) -> bool:
        try:
            self._enc.decode_single_token_bytes(i)
            return True
        except (KeyError, OverflowError):
            return False


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer for the bundled tiny model; needs no files.

    Ids 0..255 are the UTF-8 bytes of the text; then eos 256, pad 257, bos 258,
    endofchunk 259, mask 260, start_header 261, end_header 262, eot 263;
    ``vocab_size`` 264.  Always instruct, so the chat template works.
    """

    _SPECIALS = (
        "<|endoftext|>",
        "<|pad|>",
        "<|bos|>",
        "<|endofchunk|>",
        "<|mask|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    )

    def __init__(self) -> None:
        special = {s: 256 + k for k, s in enumerate(self._SPECIALS)}
        self.name = "byte"
        self.vocab_size = 256 + len(special)
        self._init_specials(special)

    def encode(self, text: str) -> list[int]:
        return list(_clean_surrogates(text).encode("utf-8"))

    def _ordinary_bytes(self, ids: list[int]) -> bytes:
        for i in ids:
            if not 0 <= i < 256:
                raise ValueError(f"token id {i} is not a byte id in {self.name}")
        return bytes(ids)


_STEERLING_BASE = ("<|endoftext|>", "<|pad|>", "<|bos|>", "<|endofchunk|>", "<|mask|>")
_STEERLING_CHAT = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


class TokenizerJsonTokenizer(Tokenizer):
    """A byte-level BPE ``tokenizer.json`` (Hugging Face ``tokenizers``) with the Steerling
    specials as added tokens: the bundled trained models' tokenizer (train/tokenizer_build.py).

    The ids are the file's. Every added token of the file is special here (the ChatML ones a
    causal model of the same family uses included): ``encode`` never emits one, because the
    text is encoded with special-token matching off (their spellings go through the byte-level
    pre-tokenizer, which splits them), and ``decode`` drops them. ``instruct=False`` leaves the
    header / eot tokens out: their ids are then unassigned, as in the base cl100k layout.

    Raises ValueError for a file that is not byte-level BPE or lacks a required special.
    """

    def __init__(self, tokenizer_file: str | Path, instruct: bool = True) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(tokenizer_file)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path} (nothing is downloaded)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            model = data.get("model") or {}
            added = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a tokenizers file ({e})") from e
        if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError(f"{path}: expected a byte-level BPE tokenizer (model BPE, decoder ByteLevel)")
        required = _STEERLING_BASE + (_STEERLING_CHAT if instruct else ())
        missing = [t for t in required if t not in added]
        if missing:
            raise ValueError(f"{path}: missing special tokens {missing} (Steerling needs {list(required)})")
        # All added tokens are matched as special in the file we encode with, and never matched in text.
        protected = dict(data, added_tokens=[dict(t, special=True) for t in data.get("added_tokens") or []])
        self._hf = HFTokenizer.from_str(json.dumps(protected))
        self._hf.encode_special_tokens = True
        self.name = f"tokenizer_json:{path.name}" + ("_instruct" if instruct else "")
        self.path = path
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        table = unicode_to_byte()
        self._added_ids = frozenset(added.values())
        self._bytes: list[bytes | None] = []
        for i in range(self.vocab_size):
            piece = self._hf.id_to_token(i)
            if piece is None or i in self._added_ids:
                self._bytes.append(None)
            else:
                try:
                    self._bytes.append(bytes(table[c] for c in piece))
                except KeyError:
                    raise ValueError(f"{path}: token {i} {piece!r} is not byte-level") from None
        chat = set(_STEERLING_CHAT)
        self._init_specials({s: i for s, i in added.items() if instruct or s not in chat})

    def unassigned_ids(self) -> list[int]:
        """Ids below vocab_size that decode to nothing: holes in the file, and (instruct=False) the
        chat specials it leaves out."""
        return [i for i, b in enumerate(self._bytes) if b is None and i not in self._special_text]

    def encode(self, text: str) -> list[int]:
        ids = self._hf.encode(_clean_surrogates(text), add_special_tokens=False).ids
        if self._added_ids.intersection(ids):  # cannot happen with encode_special_tokens; never let it through
            raise ValueError("text encoded to a special id")
        return ids

    def _ordinary_bytes(self, ids: list[int]) -> bytes:
        out = []
        for i in ids:
            b = self._bytes[i] if 0 <= i < len(self._bytes) else None
            if b is None:
                raise ValueError(f"token id {i} is not assigned (or is special) in {self.name}")
            out.append(b)
        return b"".join(out)


def load_tokenizer(spec: Mapping[str, Any], model_dir: Path | None) -> Tokenizer:
    """Build the tokenizer a model's config asks for.

    ``spec`` examples: ``{"kind": "byte"}``, ``{"kind": "cl100k",
    "bpe_file": "cl100k_base.tiktoken", "instruct": true, "sha256": "..."}``
    (``bpe_file``, ``instruct`` and ``sha256`` optional; defaults shown, no
    hash check unless given) or ``{"kind": "tokenizer_json", "file":
    "tokenizer.json", "instruct": true}`` (``file``, ``instruct`` optional).  A relative ``bpe_file`` is resolved against
    ``model_dir`` (or the working directory if None).  A non-empty
    ``CDE_CL100K_BPE`` overrides the path entirely.  Unknown keys are
    rejected so that a typo (``"instuct"``) cannot silently change the ids.
    """
    kind = spec.get("kind")
    if kind == "byte":
        _check_keys(spec, {"kind"})
        return ByteTokenizer()
    if kind == "cl100k":
        _check_keys(spec, {"kind", "bpe_file", "instruct", "sha256"})
        env = os.environ.get(BPE_ENV_VAR)
        if env:
            path = Path(env)
        else:
            path = Path(spec.get("bpe_file", "cl100k_base.tiktoken"))
            if not path.is_absolute() and model_dir is not None:
                path = Path(model_dir) / path
        instruct = spec.get("instruct", True)
        if not isinstance(instruct, bool):
            raise ValueError(f"tokenizer spec 'instruct' must be a bool, got {instruct!r}")
        return Cl100kTokenizer(path, instruct=instruct, expected_sha256=spec.get("sha256"))
    if kind == "tokenizer_json":
        _check_keys(spec, {"kind", "file", "instruct"})
        path = Path(spec.get("file", "tokenizer.json"))
        if not path.is_absolute() and model_dir is not None:
            path = Path(model_dir) / path
        instruct = spec.get("instruct", True)
        if not isinstance(instruct, bool):
            raise ValueError(f"tokenizer spec 'instruct' must be a bool, got {instruct!r}")
        return TokenizerJsonTokenizer(path, instruct=instruct)
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'byte', 'cl100k' or 'tokenizer_json')")


def _check_keys(spec: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unknown tokenizer spec keys {sorted(unknown)} for kind {spec['kind']!r}")


# config.json key -> Tokenizer attribute
_CONFIG_ID_ATTRS = {
    "eos_token_id": "eos_id", "pad_token_id": "pad_id", "bos_token_id": "bos_id",
    "endofchunk_token_id": "endofchunk_id", "mask_token_id": "mask_id",
    "start_header_id": "start_header_id", "end_header_id": "end_header_id", "eot_id": "eot_id",
}


def check_special_ids(tok: Tokenizer, expected: Mapping[str, int | None], vocab_rows: int) -> None:
    """Refuse a tokenizer whose special ids are not the model config's (``expected`` maps
    config.json keys to ids; None = the model has no such token, e.g. a base model's
    ``eot_id``), or that can produce ids past the model's ``vocab_rows`` embedding rows.
    Base and instruct cl100k tokenizers differ exactly in the three chat ids."""
    wrong = [f"{key} is {want} in config.json but {getattr(tok, _CONFIG_ID_ATTRS[key])} in {tok.name}"
             for key, want in expected.items() if getattr(tok, _CONFIG_ID_ATTRS[key]) != want]
    if wrong:
        raise ValueError(f"tokenizer {tok.name!r} does not match the model config: {'; '.join(wrong)}")
    if tok.vocab_size > vocab_rows:
        raise ValueError(f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{vocab_rows}")


def load_model_tokenizer(cfg: SteerlingConfig, model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer a model config names, checked against that config's special ids and
    vocabulary (a base checkpoint gets the base layout, an instruct one the chat ids)."""
    tok = load_tokenizer(cfg.tokenizer, None if model_dir is None else Path(model_dir))
    check_special_ids(tok, {
        "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id, "bos_token_id": cfg.bos_id,
        "endofchunk_token_id": cfg.endofchunk_id, "mask_token_id": cfg.mask_id,
        "start_header_id": cfg.start_header_id, "end_header_id": cfg.end_header_id, "eot_id": cfg.eot_id,
    }, cfg.vocab_size)
    return tok
