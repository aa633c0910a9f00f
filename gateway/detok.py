"""Streaming detokenization: block tokens -> text that never splits a character.

Blocks are committed 64 tokens at a time, and a byte-level (or BPE) token sequence can end a
block in the middle of a multi-byte UTF-8 character. Decoding each block on its own would print
two U+FFFD instead of one character, so the bytes go through one incremental UTF-8 decoder per
request that holds an incomplete sequence back until the next block completes it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cde.steerling.tokenizer import Tokenizer


@dataclass
class DetokResult:
    tokens: list[int]   # output tokens of this block: no mask/pad ids, nothing from the stop on
    text: str           # text they add (UTF-8 safe across block edges)
    stopped: bool       # a stop id was seen in this block (or earlier)
    kept: list[int] = field(default_factory=list)   # the indices in the block's raw tokens of `tokens`


class BlockDetokenizer:
    """Per-request state: turns each committed block's raw tokens into output tokens + text.

    - mask/pad/bos ids are skipped (a committed block may still carry them as padding);
    - the first stop id (EOS, EOT, or a request stop id) ends the output: it and everything
      after it, in this and later blocks, is dropped, like OpenAI drops stop sequences;
    - other special ids (e.g. <|endofchunk|>) stay in `tokens` but add no text.
    """

    def __init__(self, tokenizer: Tokenizer, extra_stop_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._stop = frozenset(tokenizer.stop_ids) | frozenset(int(i) for i in extra_stop_ids)
        self._skip = frozenset({tokenizer.mask_id, tokenizer.pad_id, tokenizer.bos_id})
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stopped = False
        self.n_tokens = 0

    def add_stops(self, stop_ids: Iterable[int]) -> None:
        """More stop ids (a Resume learns the request's own from its Accepted event)."""
        self._stop = self._stop | frozenset(int(i) for i in stop_ids)

    def feed(self, raw_tokens: Sequence[int]) -> DetokResult:
        out: list[int] = []
        kept: list[int] = []
        if not self.stopped:
            for i, t in enumerate(map(int, raw_tokens)):
                if t in self._stop:
                    self.stopped = True
                    break
                if t in self._skip:
                    continue
                out.append(t)
                kept.append(i)
        self.n_tokens += len(out)
        text = self._utf8.decode(self._tok.decode_bytes(out), final=False) if out else ""
        return DetokResult(out, text, self.stopped, kept)

    def flush(self) -> str:
        """Whatever an unfinished UTF-8 sequence at the very end decodes to (U+FFFD or "")."""
        return self._utf8.decode(b"", final=True)

    def token_text_bytes(self, token_id: int) -> bytes:
        """The bytes one output token adds to the text (a special id: none)."""
        return self._tok.decode_bytes([int(token_id)])


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's own text for attribution rows: special tokens show their spelling, and a
    byte that is only part of a character shows as U+FFFD (a lone token cannot do better)."""
    try:
        return tokenizer.token_bytes(int(token_id)).decode("utf-8", errors="replace")
    except ValueError:  # an id outside the tokenizer's vocabulary (padding rows of the embedding)
        return ""


@dataclass
class StopStringMatcher:
    """OpenAI `stop` strings, matched on the streamed text.

    Text that could still be the start of a stop string is held back until the next block
    decides; once a stop string appears, the text before it is released and the rest dropped.
    Matching is post-hoc (the engine only knows stop *ids*), so the request is cancelled
    upstream once it matches, and the block's `tokens` may extend past the cut.
    """

    stops: Sequence[str]
    _pending: str = ""
    stopped: bool = False
    _max: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.stops = [s for s in self.stops if s]
        self._max = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> str:
        """Text safe to emit now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = self._held_back(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_back(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self._max - 1, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
