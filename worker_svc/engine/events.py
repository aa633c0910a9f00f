"""What the engines report per request (queued on `req.events`, drained by AsyncEngine).

Block diffusion (SteerlingEngine): StepEvent per step (unless the request opted out),
BlockEvent when a block closes.
Causal ISD (IsdEngine): IsdCommitEvent per step that accepted tokens. Both end with a
FinishEvent (IsdFinishEvent adds the reference decoder's counters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cde.isd.decoder import DecodeStats
from cde.steerling.attribution import RawRecords


@dataclass
class StepEvent:
    request_id: str
    step: int
    positions: list[int]
    tokens: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-softmax over the raw logits at the step that committed it, and
    the most likely ids there with theirs (most likely first)."""
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class BlockEvent:
    request_id: str
    block: int
    start: int
    end: int
    tokens: list[int]          # sequence[start:end] when the block closed
    records: RawRecords | None
    last: bool = False         # the request finishes with this block
    next_step: int = 0         # the request's step counter after the block (resumes it elsewhere)
    logprobs: list[TokenLogprob | None] | None = None   # asked for: one per token (None: never sampled)


@dataclass
class FinishEvent:
    request_id: str
    reason: str                # stop | length | cancelled | error (cde.rpc.finish names)
    output_tokens: list[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    error: str = ""


@dataclass
class IsdCommitEvent:
    request_id: str
    step: int              # the request's logical forwards so far (DecodeStats.forwards)
    start: int             # index of tokens[0] in the completion
    tokens: list[int]      # accepted this step, cut at a stop
    proposed: int = 0      # drafts verified this step
    accepted: int = 0      # of those, accepted
    resumable: bool = True  # the next step is cold: committed = completion so far, next_step = step resumes exactly
    rejected: int | None = None  # the first rejected draft (tokens[accepted] is the correction in its place)


@dataclass
class IsdFinishEvent(FinishEvent):
    stats: DecodeStats = field(default_factory=DecodeStats)  # as the reference decoder counts them
    device_forwards: int = 0   # forwards the request had rows in (prefill chunks, recomputation included)
    preemptions: int = 0


Event = StepEvent | BlockEvent | IsdCommitEvent | FinishEvent
