"""The column layouts of every packed buffer between the device and the host, defined once:
the device side packs with them and the host side (or the next device step) reads with them.

* `BlockResultLayout`: a Steerling step's results, one int32 row per request row (floats as
  their bits), so one device-to-host copy brings everything back.
* `IsdResultLayout`: an ISD step's results, one int64 row per request row.
* `IsdCarry`: what an ISD step leaves on the device for an overlapped next step to derive its
  windows from (isd_runner.advance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class BlockResults(NamedTuple):
    """A Steerling step's results per row and chosen position (j < tokens_per_step)."""

    positions: Tensor      # (R, T) long absolute positions chosen
    tokens: Tensor         # (R, T) long ids drawn there
    valid: Tensor          # (R, T) bool committed this step
    target: Tensor         # (R, T) float32 raw logit of the drawn id
    logprob: Tensor | None        # (R, T) float32 its log-softmax over the raw logits; None unless asked
    top_ids: Tensor | None        # (R, T, TOP_LOGPROBS) long the most likely ids there, most likely first
    top_logprobs: Tensor | None   # (R, T, TOP_LOGPROBS) float32 their log-softmax
    known_idx: Tensor | None      # (R, T, topk_known) long; None without records
    known_logits: Tensor | None   # (R, T, topk_known) float32
    disc_idx: Tensor | None       # (R, T, topk_discovered) long
    disc_logits: Tensor | None    # (R, T, topk_discovered) float32


_FLOAT_FIELDS = frozenset({"target", "logprob", "top_logprobs", "known_logits", "disc_logits"})
_SAMPLED = ("positions", "tokens", "valid", "target")
_LOGPROBS = ("logprob", "top_ids", "top_logprobs")
TOP_LOGPROBS = 20   # alternatives computed per committed token (cde/limits.py's TOP_LOGPROBS_MAX)


@dataclass(frozen=True)
class BlockResultLayout:
    """Columns of `BlockResults` fields in order, each tokens_per_step (x top-k for records) wide."""

    tokens_per_step: int   # the step's bucket: the most positions any row may commit
    topk_known: int
    topk_discovered: int

    def widths(self) -> dict[str, int]:
        t = self.tokens_per_step
        return {"positions": t, "tokens": t, "valid": t, "target": t,
                "logprob": t, "top_ids": t * TOP_LOGPROBS, "top_logprobs": t * TOP_LOGPROBS,
                "known_idx": t * self.topk_known, "known_logits": t * self.topk_known,
                "disc_idx": t * self.topk_discovered, "disc_logits": t * self.topk_discovered}

    @property
    def width(self) -> int:
        """All columns: what `pack` returns per row."""
        return sum(self.widths().values())

    @property
    def sampled_width(self) -> int:
        """Columns of the first four fields: all a step without concept records or logprobs copies back."""
        return 4 * self.tokens_per_step

    @property
    def logprobs_width(self) -> int:
        """Columns up to the logprobs' end: what a step with logprobs but no records copies back."""
        w = self.widths()
        return sum(w[n] for n in _SAMPLED + _LOGPROBS)

    def columns(self, records: bool, logprobs: bool) -> int:
        """Leading columns a step copies back."""
        return self.width if records else self.logprobs_width if logprobs else self.sampled_width

    def pack(self, **named: Tensor) -> Tensor:
        """(R, columns) int32: ints as values, floats as their bits, fields in layout order."""
        r = named["positions"].shape[0]
        parts = []
        for name in self.widths():
            t = named[name]
            parts.append((t.float().contiguous().view(torch.int32) if name in _FLOAT_FIELDS
                          else t.to(torch.int32)).reshape(r, -1))
        return torch.cat(parts, dim=1)

    def unpack(self, packed: Tensor) -> BlockResults:
        """The host copy of `pack`'s output, or of its first `columns(...)`, as typed tensors
        (the fields not copied None)."""
        r, t = packed.shape[0], self.tokens_per_step
        widths = self.widths()
        names, cols = [], 0
        for name, w in widths.items():
            if cols + w > packed.shape[1]:
                break
            names.append(name)
            cols += w
        parts = dict(zip(names, packed[:, :cols].split([widths[n] for n in names], 1)))
        out = {}
        for name, part in parts.items():
            value = part.contiguous().view(torch.float32) if name in _FLOAT_FIELDS else part.long()
            out[name] = value if name in _SAMPLED or name == "logprob" else value.view(r, t, widths[name] // t)
        out["valid"] = out["valid"].bool()
        return BlockResults(**{name: out.get(name) for name in BlockResults._fields})


@dataclass(frozen=True)
class IsdResultLayout:
    """(R, n_drafts + 3) int64: [clean token, n_drafts new drafts, n_accepted, correction]."""

    n_drafts: int          # the step's K: the most drafts any row proposes

    CLEAN = 0

    @property
    def drafts(self) -> slice:
        return slice(1, 1 + self.n_drafts)

    @property
    def n_accepted(self) -> int:
        return 1 + self.n_drafts

    @property
    def correction(self) -> int:
        return 2 + self.n_drafts

    @property
    def width(self) -> int:
        return 3 + self.n_drafts

    @staticmethod
    def pack(clean: Tensor, new_drafts: Tensor, n_accepted: Tensor, correction: Tensor) -> Tensor:
        return torch.cat([clean[:, None], new_drafts, n_accepted.long()[:, None], correction.long()[:, None]], dim=1)


class IsdCarry:
    """Columns of the ISD runner's carry buffer: the row's window start, whether it verified,
    its logical forward count, then the step's `IsdResultLayout` row."""

    WIN_POS, VERIFY, FWD = 0, 1, 2
    RESULTS = 3   # first column of the packed results

    @classmethod
    def width(cls, max_drafts: int) -> int:
        return cls.RESULTS + IsdResultLayout(max_drafts).width

    @classmethod
    def pack(cls, win_pos: Tensor, verify_row: Tensor, fwd_index: Tensor, results: Tensor) -> Tensor:
        return torch.cat([win_pos[:, None], verify_row.long()[:, None], fwd_index[:, None], results], 1)
