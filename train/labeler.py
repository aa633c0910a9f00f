"""Tag tokens and 64-token chunks with known concepts.

Per token (`TOKEN_K` slots, `NO_LABEL` = empty): the concepts of the word it belongs to (the
lexicon's priority order: story > WordNet synsets > Empath > Roget > WordNet lexname), the word
found by its base form (WordNet exception lists, then WordNet's suffix rules with the most
frequent candidate), plus `dialogue` inside quotation marks and a tone concept for words with
VADER |valence| >= 2. Per chunk (`CHUNK_K` slots): the concepts of its tokens, most frequent
first, plus the chunk's tone from a VADER-style compound score of its words (|compound| >= 0.5,
>= 0.9 for "very"). Only the stdlib, numpy and `tokenizers`: runs on the GPU machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.concepts import Lexicon

TOKEN_K = 8
CHUNK_K = 32
CHUNK = 64
NO_LABEL = 0xFFFF

_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")
_QUOTE = re.compile(r"\"[^\"\n]{1,600}\"|\u201c[^\u201d\n]{1,600}\u201d")
_RULES = (("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"), ("ies", "y"),
          ("s", ""), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", ""),
          ("er", ""), ("est", ""), ("er", "e"), ("est", "e"))
_PLURAL_SUFFIXES = frozenset(("s", "es", "ses", "xes", "zes", "ches", "shes", "ies", "men"))
_CACHE_LIMIT = 2_000_000  # distinct word forms remembered (bounded memory)


@dataclass
class Labeled:
    ids: np.ndarray          # (n,) token ids
    labels: np.ndarray       # (n, TOKEN_K) uint16, NO_LABEL padded
    valence: np.ndarray      # (n,) float32: VADER valence of the word a token starts, else 0


class Labeler:
    def __init__(self, lexicon: Lexicon, tokenizer_file: str | Path):
        from tokenizers import Tokenizer

        self.lex = lexicon
        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.tok.encode_special_tokens = True  # text never becomes a special id
        self._stop = frozenset(lexicon.stop)
        self._verbal = frozenset(lexicon.verbal_story_ids)
        self._story = frozenset(lexicon.story_ids)
        self._story_arr = np.asarray(sorted(self._story), np.int64)
        # word -> row of a concept table (row 0: no concepts), so a text's words are looked up
        # once each and their tokens filled with numpy
        self._rows: dict[str, int] = {}
        self._conc: list[tuple[int, ...]] = [(NO_LABEL,) * TOKEN_K]
        self._val: list[float] = [0.0]
        self._table: tuple[np.ndarray, np.ndarray] | None = None
        self._tone_tokens = (lexicon.tone_ids["positive tone"], lexicon.tone_ids["negative tone"])
        self._tone_set = frozenset(lexicon.tone_ids.values())

    # ---- words
    def base_forms(self, word: str) -> list[tuple[str, bool]]:
        """(lexicon entry, is it a noun form) pairs that `word` (lower case) is, or is an
        inflection of: the word itself, its WordNet exception-list bases, and the most frequent
        suffix-rule candidate (only when nothing else matched, or when that candidate is a
        story word: "singing" is a WordNet noun and also a form of the story's "sing")."""
        words = self.lex.words
        out: list[tuple[str, bool]] = [(word, True)] if word in words else []
        for b in self.lex.noun_forms.get(word, ()):
            if b in words and b not in (x for x, _ in out):
                out.append((b, True))
        for b in self.lex.exceptions.get(word, ()):
            if b in words and b not in (x for x, _ in out):
                out.append((b, False))
        best, best_suf = None, ""
        for suf, rep in _RULES:
            if word.endswith(suf) and len(word) >= len(suf) + 3:
                b = word[: -len(suf)] + rep
                # short stems from long suffixes are mostly wrong ("being" -> "bee")
                if b in words and (suf not in ("ing", "ed", "er", "est") or len(b) >= 4) and (
                        best is None or self.lex.freq.get(b, 0) > self.lex.freq.get(best, 0)):
                    best, best_suf = b, suf
        if best is not None and best not in (x for x, _ in out) and (
                not out or (best_suf not in ("er", "est") and self._story & set(words[best]))):
            out.append((best, best_suf in _PLURAL_SUFFIXES))
        return out

    def word_concepts(self, word: str) -> tuple[int, ...]:
        """Concept ids of a word, story concepts first, then the lexicon's priority order. A
        story noun concept needs the word itself or a plural ("born" is not "bear")."""
        ids: list[int] = []
        for b, noun_form in self.base_forms(word.lower()):
            ids += [i for i in self.lex.words[b] if i not in ids and (
                noun_form or i not in self._story or i in self._verbal)]
        ids.sort(key=lambda i: 0 if i in self._story else 1)  # stable: keeps the rest in order
        return tuple(ids)

    def _row(self, word: str) -> int:
        """Index of `word`'s row in the concept table (0 = nothing), cached (bounded)."""
        r = self._rows.get(word)
        if r is not None:
            return r
        if (word in self._stop or len(word) < 3) and word not in self.lex.words:
            concepts: tuple[int, ...] = ()  # function words and fragments ("was" is not "WA")
        else:
            concepts = self.word_concepts(word)[:TOKEN_K]
        v = self.lex.valence.get(word, 0.0)
        if not concepts and not v:
            r = 0
        else:
            r = len(self._val)
            self._val.append(v)
            self._conc.append(concepts + (NO_LABEL,) * (TOKEN_K - len(concepts)))
            self._table = None
        if len(self._rows) < _CACHE_LIMIT:
            self._rows[word] = r
        return r

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            self._table = (np.asarray(self._conc, np.uint16), np.asarray(self._val, np.float32))
        return self._table

    # ---- text
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def label_text(self, text: str) -> Labeled:
        enc = self.tok.encode(text, add_special_tokens=False)
        return self._label(text, enc.ids, enc.offsets)

    def label_texts(self, texts: list[str]) -> list[Labeled]:
        return [self._label(t, e.ids, e.offsets) for t, e in zip(texts, self.tok.encode_batch(texts, add_special_tokens=False))]

    def _label(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> Labeled:
        n = len(ids)
        labels = np.full((n, TOKEN_K), NO_LABEL, np.uint16)
        valence = np.zeros(n, np.float32)
        if n == 0:
            return Labeled(np.asarray(ids, np.int64), labels, valence)
        off = np.asarray(offsets, np.int64).reshape(n, 2)
        starts, ends = off[:, 0], off[:, 1]
        w_start: list[int] = []
        w_end: list[int] = []
        w_row: list[int] = []
        rows, row_of, not_before = self._rows, self._row, self.lex.not_before
        for m in _WORD.finditer(text):
            lw = m.group().lower()
            r = rows.get(lw)
            if r is None:
                r = row_of(lw)
            if r:
                if lw in not_before:
                    nxt = _WORD.match(text, m.end() + 1)
                    if nxt and nxt.group().lower() in not_before[lw]:
                        continue
                w_start.append(m.start())
                w_end.append(m.end())
                w_row.append(r)
        if w_row:
            conc, val = self._tables()
            r = np.asarray(w_row, np.int64)
            a = np.searchsorted(ends, np.asarray(w_start, np.int64), "right")
            b = np.searchsorted(starts, np.asarray(w_end, np.int64), "left")
            ok = b > a
            r, a, b = r[ok], a[ok], b[ok]
            valence[a] = val[r]
            span = b - a
            for j in range(int(span.max(initial=0))):
                sel = span > j
                labels[a[sel] + j] = conc[r[sel]]
            # tone on strongly valenced words, in the first free slot
            v = val[r]
            strong = np.abs(v) >= 2.0
            if strong.any():
                pos, neg = self._tone_tokens
                self._put(labels, a[strong], np.where(v[strong] > 0, pos, neg))
        if self.lex.dialogue_id >= 0 and ('"' in text or "\u201c" in text):
            toks = [np.arange(int(np.searchsorted(ends, m.start(), "right")), int(np.searchsorted(starts, m.end(), "left")))
                    for m in _QUOTE.finditer(text)]
            if toks:
                t = np.concatenate(toks)
                self._put(labels, t, np.full(len(t), self.lex.dialogue_id))
        return Labeled(np.asarray(ids, np.int64), labels, valence)

    @staticmethod
    def _put(labels: np.ndarray, tokens: np.ndarray, concept: np.ndarray) -> None:
        """Write concept[i] into the first free slot of row tokens[i] (dropped if the row is full)."""
        if tokens.size == 0:
            return
        free = labels[tokens] == NO_LABEL
        has = free.any(1)
        slot = free.argmax(1)
        labels[tokens[has], slot[has]] = concept[has]

    # ---- chunks
    def chunk_labels(self, labels: np.ndarray, valence: np.ndarray) -> np.ndarray:
        """(n_chunks, CHUNK_K) uint16 for token arrays whose length is a multiple of CHUNK."""
        n = labels.shape[0]
        if n % CHUNK:
            raise ValueError(f"token count {n} is not a multiple of {CHUNK}")
        n_chunks = n // CHUNK
        out = np.full((n_chunks, CHUNK_K), NO_LABEL, np.uint16)
        lab = labels.reshape(n_chunks, CHUNK * TOKEN_K)
        s = valence.reshape(n_chunks, CHUNK).astype(np.float64).sum(1)
        compound = s / np.sqrt(s * s + 15.0)
        tone = self.lex.tone_ids
        for i in range(n_chunks):
            row = lab[i]
            row = row[row != NO_LABEL]
            picked: list[int] = []
            if row.size:
                vals, counts = np.unique(row, return_counts=True)
                keep = ~np.isin(vals, list(self._tone_set))
                vals, counts = vals[keep], counts[keep]
                story = np.isin(vals, self._story_arr)
                order = np.lexsort((vals, -counts, ~story))  # story concepts, then most frequent, then lower id
                picked = [int(v) for v in vals[order][: CHUNK_K - 2]]
            c = compound[i]
            if c >= 0.5:
                picked.append(tone["positive tone"])
                if c >= 0.9:
                    picked.append(tone["very positive tone"])
            elif c <= -0.5:
                picked.append(tone["negative tone"])
                if c <= -0.9:
                    picked.append(tone["very negative tone"])
            out[i, : len(picked)] = picked
        return out
