"""The serving side of a Qwen3 tokenizer: the interface the gateway streams text through.

The gateway was written against the Steerling tokenizer (`encode`, `apply_chat_template`,
`decode_bytes`, `token_bytes`, the special ids). `ChatTokenizer` gives a causal model's
`tokenizer.json` the same surface, so detokenization (UTF-8 safe across streamed blocks),
stop ids and prompt validation are shared code. Byte-level BPE (Qwen's) maps every token to
its exact bytes; chat prompts use the ChatML template Qwen3 / I-DLM instruct models use.
No torch here: the gateway imports it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from cde.byte_level import unicode_to_byte
from cde.qwen3.config import Qwen3Config
from cde.qwen3.tokenizer import TOKENIZER_FILE, Qwen3Tokenizer, load_tokenizer

CHAT_ROLES = ("system", "user", "assistant")


class ChatTokenizer:
    """`Qwen3Tokenizer` + the special ids and byte-exact decoding the gateway needs."""

    def __init__(self, tok: Qwen3Tokenizer, cfg: Qwen3Config):
        self.tok = tok
        self.vocab_size = tok.vocab_size
        self.mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else -1
        self.bos_id = cfg.bos_token_id if cfg.bos_token_id is not None else -1
        self.pad_id = -1
        self.stop_ids = frozenset(cfg.eos_token_ids)
        data = json.loads(Path(tok.path).read_text(encoding="utf-8"))
        self.byte_level = (data.get("decoder") or {}).get("type") == "ByteLevel"
        self._added = {int(t["id"]): t["content"] for t in data.get("added_tokens") or []}
        self._im_start = tok.token_to_id("<|im_start|>")
        self._im_end = tok.token_to_id("<|im_end|>")

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self.tok.special_tokens)

    def unassigned_ids(self) -> list[int]:
        return self.tok.unassigned_ids()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """ChatML: <|im_start|>role\\ncontent<|im_end|>\\n ... <|im_start|>assistant\\n.
        Message text is encoded as ordinary text (it can never produce a special id)."""
        if self._im_start is None or self._im_end is None:
            raise ValueError("this model's tokenizer has no <|im_start|>/<|im_end|> tokens: use a plain prompt")
        newline = self.tok.encode("\n")
        ids: list[int] = []
        for m in messages:
            role = m.get("role", "")
            if role not in CHAT_ROLES:
                raise ValueError(f"unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
            ids += [self._im_start] + self.tok.encode(role) + newline + self.tok.encode(m.get("content", ""))
            ids += [self._im_end] + newline
        if add_generation_prompt:
            ids += [self._im_start] + self.tok.encode("assistant") + newline
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """One token's exact bytes (special tokens: their spelling). ValueError if unknown."""
        i = int(token_id)
        if i in self._added:
            return self._added[i].encode("utf-8")
        piece = self.tok.id_to_token(i) if i >= 0 else None
        if piece is None:
            raise ValueError(f"token id {i} is not assigned in {self.tok.path}")
        if not self.byte_level:
            return self.tok.decode([i], skip_special=False).encode("utf-8")
        table = unicode_to_byte()
        return bytes(table[c] for c in piece)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Bytes of ordinary tokens; special ids add nothing (as in the Steerling tokenizer).
        An id of the model's padded vocabulary that the tokenizer does not assign (a model
        can sample one) becomes U+FFFD rather than failing the stream."""
        special = self.tok.special_ids
        out = []
        for i in ids:
            if int(i) in special:
                continue
            try:
                out.append(self.token_bytes(i))
            except ValueError:
                out.append("\ufffd".encode())
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special=skip_special)


def load_chat_tokenizer(model_dir: str | Path, cfg: Qwen3Config | None = None) -> ChatTokenizer:
    cfg = cfg or Qwen3Config.load(model_dir)
    return ChatTokenizer(load_tokenizer(model_dir, cfg), cfg)


def write_byte_tokenizer(path: str | Path, specials: Sequence[str]) -> dict[str, int]:
    """A byte-level BPE tokenizer.json with no merges (ids 0..255 = bytes) plus `specials`
    (ids 256...): a real tokenizers file for tiny demo/test models. Returns spelling -> id."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models

    vocab = dict(unicode_to_byte())
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return {s: tok.token_to_id(s) for s in specials}


__all__ = ["ChatTokenizer", "TOKENIZER_FILE", "load_chat_tokenizer", "write_byte_tokenizer"]
