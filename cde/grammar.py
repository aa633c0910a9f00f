"""Structured output: a request's `response_format` (JSON object, JSON schema, regex) compiled to a
grammar, and the per-request matcher the engine asks for each step's allowed tokens.

The grammar engine is llguidance (MIT, maintained by Microsoft, the one vLLM, SGLang and
llama.cpp ship): JSON schema, regex and Lark through one Earley parser with a lazy lexer, so a
mask costs tens of microseconds on a 100K-token vocabulary and a schema compiles in milliseconds
with nothing precomputed per vocabulary. outlines-core compiles a schema to one regex and then
to a token-level index built up front (seconds for large schemas, per tokenizer) and has no
general grammars; for a server taking arbitrary schemas per request that start-up is the cost
that matters.

Two halves: the gateway checks REST's `response_format` into the public proto's ResponseFormat
(`response_format_fields`), compiles and validates it (`compile_format`: a grammar string, or
`GrammarError` naming the field for a 400; `compile_response_format` does both) and sends the
grammar with the request; the worker
builds a `Constraint` per request from it with the model's vocabulary (`GrammarVocabulary`).
The engine calls `allowed()` before a step and `advance(token)` after it: exact masking of the
model's distribution, nothing sampled outside the grammar. The request ends with the model's end
token (`<|eot_id|>` for Steerling models), which the matcher allows only where the grammar accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

MAX_GRAMMAR_CHARS = 64 * 1024   # a schema / regex bigger than this is refused (400)


class GrammarError(ValueError):
    """A response_format the grammar engine refuses: `field` names the request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _llg():
    import llguidance   # imported on use: only servers taking structured output need it
    return llguidance


def _validated(grammar: str, field: str) -> str:
    err = _llg().LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(field, f"the grammar engine refused it: {err.strip()[:500]}")
    return grammar


def json_schema_grammar(schema: Mapping[str, Any], field: str = "response_format.json_schema.schema") -> str:
    """A compact-JSON grammar for `schema` (no whitespace between tokens, as json.dumps with
    separators=(",", ":"); leaves the model no freedom to pad forever)."""
    if not isinstance(schema, Mapping):
        raise GrammarError(field, "must be a JSON object (a JSON schema)")
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(field, f"is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    except ValueError as e:
        raise GrammarError(field, str(e)[:500]) from None
    return _validated(grammar, field)


def regex_grammar(regex: str, field: str = "response_format.regex") -> str:
    if not isinstance(regex, str) or not regex:
        raise GrammarError(field, "must be a non-empty string (a regular expression)")
    if len(regex) > MAX_GRAMMAR_CHARS:
        raise GrammarError(field, f"is {len(regex)} characters; at most {MAX_GRAMMAR_CHARS}")
    return _validated(_llg().LLMatcher.grammar_from_regex(regex), field)


def compile_response_format(response_format: Mapping[str, Any] | None) -> str | None:
    """OpenAI's `response_format` -> a grammar string (None: free text).

    {"type": "text"}; {"type": "json_object"} (any JSON object); {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; and, as SGLang and vLLM accept
    beside it, {"type": "regex", "regex": "..."}."""
    fields = response_format_fields(response_format)
    (which, value), = fields.items() if fields else ((None, None),)
    return compile_format(which, value)


def response_format_fields(response_format: Mapping[str, Any] | None) -> dict[str, Any]:
    """REST's `response_format` -> the fields of the public proto's ResponseFormat (checked in
    shape here; the grammar itself compiles in `compile_format`). {} for free text."""
    if response_format is None:
        return {}
    if not isinstance(response_format, Mapping):
        raise GrammarError("response_format", "must be a JSON object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema", "must be an object with a `schema`")
        if "schema" not in spec:
            raise GrammarError("response_format.json_schema.schema", "is required")
        if not isinstance(spec["schema"], Mapping):
            raise GrammarError("response_format.json_schema.schema", "must be a JSON object (a JSON schema)")
        return {"json_schema": json.dumps(spec["schema"])}
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not regex:
            raise GrammarError("response_format.regex", "must be a non-empty string (a regular expression)")
        return {"regex": regex}
    raise GrammarError("response_format.type", f"must be text, json_object, json_schema or regex; got {kind!r}")


def compile_format(which: str | None, value: Any) -> str | None:
    """The proto's ResponseFormat oneof (`which` field, its value) -> a grammar (None: free text)."""
    if which is None:
        return None
    if which == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format") if value else None
    if which == "json_schema":
        if len(value) > MAX_GRAMMAR_CHARS:
            raise GrammarError("response_format.json_schema.schema", f"is {len(value)} characters; at most {MAX_GRAMMAR_CHARS}")
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise GrammarError("response_format.json_schema.schema", f"is not valid JSON: {e}") from None
        return json_schema_grammar(schema)
    if which == "regex":
        return regex_grammar(value)
    raise GrammarError("response_format", f"unknown format {which!r}")


class GrammarVocabulary:
    """The model's vocabulary as the grammar engine sees it: each id's bytes (special tokens marked
    special: no grammar ever produces them), `end_ids` the tokens that end a constrained output
    (allowed only where the grammar may end)."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: Sequence[int], end_ids: Sequence[int],
                 encode: Callable[[str], list[int]]):
        llg = _llg()
        self.size = len(token_bytes)
        self.end_ids = [int(i) for i in end_ids]
        if not self.end_ids:
            raise ValueError("structured output needs an end token")
        end_id = self.end_ids[0]
        specials = sorted(set(special_ids) | set(self.end_ids))
        tokens = list(token_bytes)
        for i in specials:   # llguidance's convention for special tokens: a leading 0xFF byte
            tokens[i] = b"\xff" + (tokens[i] or f"<special_{i}>".encode())
        for i, t in enumerate(tokens):
            if not t:        # an id that decodes to nothing (padding rows, holes): special too
                tokens[i] = f"\xff<unused_{i}>".encode("latin-1")
                specials.append(i)

        class _Wrapped:   # what llguidance's TokenizerWrapper reads
            eos_token_id = end_id
            bos_token_id = None
            special_token_ids = specials

            def __call__(self, s: bytes) -> list[int]:
                return encode(s.decode("utf-8", errors="replace"))

        wrapped = _Wrapped()
        wrapped.tokens = tokens
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(wrapped), n_vocab=self.size, eos_token=self.end_ids)

    @classmethod
    def of_steerling(cls, tokenizer, vocab_rows: int, end_id: int) -> GrammarVocabulary:
        """A Steerling tokenizer (cde.steerling.tokenizer) over the model's `vocab_rows` embedding rows."""
        unassigned = set(tokenizer.unassigned_ids())
        token_bytes = [b"" if i >= tokenizer.vocab_size or i in unassigned else tokenizer.token_bytes(i)
                       for i in range(vocab_rows)]
        return cls(token_bytes, sorted(tokenizer.special_ids), [end_id], tokenizer.encode)

    @classmethod
    def of_byte_level(cls, tokenizer, vocab_rows: int, end_ids: Sequence[int]) -> GrammarVocabulary:
        """A byte-level BPE tokenizer.json tokenizer (cde.qwen3.tokenizer.Qwen3Tokenizer: the causal
        models'), its spellings mapped back to bytes (GPT-2's alphabet), over `vocab_rows` rows."""
        from cde.byte_level import unicode_to_byte
        table = unicode_to_byte()
        token_bytes = []
        for i in range(vocab_rows):
            piece = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else None
            if piece is None or i in tokenizer.special_ids:
                token_bytes.append(b"")
                continue
            try:
                token_bytes.append(bytes(table[c] for c in piece))
            except KeyError:
                raise ValueError(f"token {i} {piece!r} is not byte-level: structured output needs a byte-level "
                                 "BPE tokenizer") from None
        return cls(token_bytes, sorted(tokenizer.special_ids), end_ids, tokenizer.encode)

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One request's grammar state: which ids may come next, advanced by each committed id."""

    def __init__(self, vocab: GrammarVocabulary, grammar: str):
        self.vocab = vocab
        self.matcher = _llg().LLMatcher(vocab.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError("response_format", self.matcher.get_error()[:500])

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the ids the grammar allows next (the end id where it may end)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab.size].astype(bool)

    def allowed_along(self, tokens: Sequence[int]) -> np.ndarray:
        """(len(tokens) + 1, vocab) bool: row j is what the grammar allows after `tokens[:j]` (a
        draft window's masks), the state left unchanged. Rows after the first token the grammar
        refuses, or after an end token, are all True (nothing reads them: that token is rejected,
        or the output ends there)."""
        out = np.ones((len(tokens) + 1, self.vocab.size), dtype=bool)
        consumed = 0
        for j in range(len(tokens) + 1):
            out[j] = self.allowed()
            if (j == len(tokens) or not out[j][tokens[j]] or tokens[j] in self.vocab.end_ids
                    or not self.matcher.consume_token(int(tokens[j]))):
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def advance(self, token: int) -> None:
        """Consume a committed id; ValueError for an id the grammar does not allow (a resumed
        request's committed tokens that do not match it; in a step, a bug)."""
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            raise ValueError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")
