"""Tokenizer for Qwen3 / I-DLM models from a local ``tokenizer.json`` (no downloads).

Uses the Rust ``tokenizers`` library (a dependency of transformers). One rule matters
for serving: **user text can never produce a special id**. ``tokenizers`` matches added
tokens inside text even with ``add_special_tokens=False`` (that flag only controls the
post-processor's BOS/EOS template), so ``"<|MASK|>"`` or ``"<|im_end|>"`` typed by a user
would become control tokens. We therefore encode text with a second tokenizer built from
the same file in which the protected tokens are marked special and special tokens are not
matched in text (``encode_special_tokens``): their spellings go through the ordinary
pre-tokenizer and BPE, exactly like transformers' ``split_special_tokens=True``.

Protected ids: every added token marked ``special`` plus the added tokens whose ids the
caller names (the mask, BOS and EOS ids of the model config), even where the file does
not mark them special (ids that are plain vocabulary entries cannot be protected). Added tokens that are *not* special (Qwen3's ``<think>``, ``<tool_call>``) keep
transformers' behaviour and are matched in text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from cde.qwen3.config import Qwen3Config

TOKENIZER_FILE = "tokenizer.json"


def _clean_surrogates(text: str) -> str:
    """Lone surrogates cannot be UTF-8 encoded: replace them with U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Qwen3Tokenizer:
    """``encode`` (ordinary text, never a protected id, no BOS/EOS) and ``decode``.

    Attributes: ``vocab_size`` (ids the tokenizer knows, added tokens included; the
    model's embedding table may be larger), ``special_ids`` (protected ids),
    ``special_tokens`` (spelling -> id of those), ``path``.
    """

    def __init__(self, tokenizer_file: str | Path, *, protected_ids: Iterable[int | None] = ()):
        path = Path(tokenizer_file)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path} (nothing is downloaded; "
                                    f"put the model's {TOKENIZER_FILE} there)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            self._full = _HFTokenizer.from_str(json.dumps(data))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ValueError(f"{path}: not a valid tokenizers file ({type(e).__name__}: {e})") from e
        self.path = path
        protected = {int(i) for i in protected_ids if i is not None}
        added = data.get("added_tokens") or []
        self.special_tokens: dict[str, int] = {
            t["content"]: int(t["id"]) for t in added if t.get("special") or int(t["id"]) in protected}
        self.special_ids = frozenset(self.special_tokens.values())
        self._special_text = {i: s for s, i in self.special_tokens.items()}
        # The ordinary tokenizer: same file, protected tokens marked special, and special
        # tokens not matched in text (encode_special_tokens). Removing them from the added
        # vocabulary instead would renumber the added tokens after them.
        ordinary = dict(data, added_tokens=[dict(t, special=True) if int(t["id"]) in self.special_ids else t
                                            for t in added])
        self._ordinary = _HFTokenizer.from_str(json.dumps(ordinary))
        self._ordinary.encode_special_tokens = True
        full_added = {i: t.content for i, t in self._full.get_added_tokens_decoder().items()}
        if {i: t.content for i, t in self._ordinary.get_added_tokens_decoder().items()} != full_added:
            raise ValueError(f"{path}: added tokens changed ids when protecting special tokens")
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        # A protected spelling that is also a whole entry of the model vocabulary would still
        # encode to its id; refuse such a file rather than let text forge the token.
        for spelling, i in self.special_tokens.items():
            leaked = self.special_ids.intersection(self._ordinary.encode(spelling, add_special_tokens=False).ids)
            if leaked:
                raise ValueError(f"{path}: the text {spelling!r} encodes to special id {min(leaked)} even as "
                                 f"ordinary text; cannot keep user text from producing it")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as ordinary text: no BOS/EOS, never a protected id."""
        return self._ordinary.encode(_clean_surrogates(text), add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        """Trusted text only (templates): special spellings become their ids."""
        return self._full.encode(_clean_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; protected ids dropped (or spelled out with ``skip_special=False``).
        ValueError for ids the tokenizer does not know."""
        ids = [int(i) for i in ids]
        for i in ids:
            if i < 0 or self._full.id_to_token(i) is None:
                raise ValueError(f"token id {i} is not assigned in {self.path}")
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        return self._full.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._full.token_to_id(token)

    def unassigned_ids(self) -> list[int]:
        """Ids below vocab_size that the file assigns to nothing (``decode`` refuses them): never
        to be sampled. Empty for a file whose ids are dense, as most are."""
        return [i for i in range(self.vocab_size) if self._full.id_to_token(i) is None]

    def id_to_token(self, i: int) -> str | None:
        return self._full.id_to_token(i)

    def __repr__(self) -> str:
        return f"<Qwen3Tokenizer {str(self.path)!r} vocab_size={self.vocab_size}>"


def load_tokenizer(model_dir: str | Path, cfg: Qwen3Config | None = None) -> Qwen3Tokenizer:
    """``model_dir/tokenizer.json``; the config's mask, BOS and EOS ids are protected."""
    protected: list[int | None] = []
    if cfg is not None:
        protected = [cfg.mask_token_id, cfg.bos_token_id, *cfg.eos_token_ids]
    return Qwen3Tokenizer(Path(model_dir) / TOKENIZER_FILE, protected_ids=protected)
