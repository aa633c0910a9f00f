"""Scheduler streams, read as public GenerateResponse events.

`GenerationStream` wraps one scheduler Submit or Resume call: it turns SchedulerEvents into
GenerateResponses (detokenized blocks, usage that counts exactly the tokens returned) and,
because the gateway holds the request id, reattaches a broken scheduler stream itself instead
of failing the client: it re-Submits the same request (idempotent) when it was not accepted
yet, else Resumes after the last block it has, with bounded retries and backoff inside the
request's deadline (`Reattach`). A client sees a scheduler restart as latency. An error that
ended the request itself (the scheduler marks it with `cde-request-ended` trailing metadata)
is reported, never retried.

Closing a stream before the request ended (the client disconnected, a stop string matched)
cancels the scheduler call and calls `on_detach`, which tells the scheduler the client left
(`Scheduler.Detach` with the stream's `cde-attach-id`). A stream that merely breaks, without
that Detach (this gateway process died), leaves the request running for the scheduler's
detach grace, so the client can Resume it on another gateway process.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cde import trace
from cde.rpc.finish import FINISH_REASON_TEXT
from cde.rpc.v1 import common_pb2, generate_pb2, scheduler_pb2
from gateway.detok import BlockDetokenizer
from gateway.errors import GatewayError, from_rpc_error
from gateway.metrics import RequestTimer

log = logging.getLogger("gateway.stream")

# Scheduler errors a stream is reattached after (unless the request itself ended with them).
REATTACH_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
REQUEST_ENDED_MD = "cde-request-ended"   # scheduler_svc.service.REQUEST_ENDED_MD
REATTACH_BACKOFF_S = (0.05, 1.0)         # first and largest pause between attempts
ATTACH_MD = "cde-attach-id"              # scheduler_svc.service.ATTACH_MD: names a stream for Detach


@dataclass
class GenerationStream:
    """One scheduler call, read as public GenerateResponse events.

    `next()` returns None after Finished. Errors from the scheduler surface as GatewayError at
    the `next()` that hits them; front ends pull the first event before answering so that an
    admission refusal still becomes a proper status (429, 404, ...) and not a broken stream.
    """

    call: grpc.aio.UnaryStreamCall
    detok: BlockDetokenizer
    timer: RequestTimer
    seed: int
    prompt_tokens: int
    done: bool = False
    finish_reason: str | None = None
    skip_through: int | None = None   # Resume: blocks up to this index only prime the detokenizer
    isd: bool = False                 # a causal model's request: report ISD acceptance
    request_id: str = ""
    reattach: Reattach | None = None  # None: a broken scheduler stream is an error at once
    reattached: int = 0               # how many times the scheduler call was replaced
    opened_at: float | None = None    # perf_counter when the scheduler call was opened (cde.trace)
    attach_id: str = ""               # this stream's `cde-attach-id` (its Detach names it)
    on_detach: Callable[[str, str], None] | None = None   # (request id, attach id): the client left
    _accepted: bool = field(default=False)
    _last_block: int | None = field(default=None)   # last block index fed to the detokenizer
    _replayed_through: int | None = field(default=None)   # after a reattach: blocks we already had
    _primed_tokens: int = field(default=0)
    _closed: bool = field(default=False)
    _ended: bool = field(default=False)   # the request's end was seen (Finished, or an error that ended it)
    # usage: characters of this response's text after each of its output tokens (the tokens'
    # bytes through their own UTF-8 decoder, primed like the detokenizer's on a Resume). Only a
    # stop string needs them, so the blocks' tokens wait in _uncounted until tokens_in_text asks
    # (one decode per token was half of a block's translation: ~0.07 ms of 0.14 with cl100k).
    _text_ends: list[int] = field(default_factory=list)
    _chars: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _uncounted: list[tuple[list[int], bool]] = field(default_factory=list)   # (tokens, primed) in order
    _response_tokens: int = field(default=0)

    def __post_init__(self) -> None:
        self.timer.metrics.in_flight.labels(self.timer.metrics.model).inc()

    # ---- usage: the tokens this response holds -------------------------------------------
    @property
    def response_tokens(self) -> int:
        """Output tokens this response carries (a Resume's: those after the blocks skipped)."""
        return self._response_tokens

    def tokens_in_text(self, n_chars: int) -> int:
        """Tokens that the first `n_chars` characters of this response's text hold: the shortest
        prefix of its tokens whose text covers them (a token a stop string cuts through counts;
        text-less tokens right after the cut do not). What usage counts after a stop string."""
        if n_chars <= 0:
            return 0
        self._count_text()
        return min(bisect.bisect_left(self._text_ends, n_chars) + 1, len(self._text_ends))

    def _note_tokens(self, tokens: list[int], primed: bool) -> None:
        self._uncounted.append((tokens, primed))
        if not primed:
            self._response_tokens += len(tokens)

    def _count_text(self) -> None:
        for tokens, primed in self._uncounted:
            total = self._text_ends[-1] if self._text_ends else 0
            for t in tokens:
                total += len(self._chars.decode(self.detok.token_text_bytes(t), final=False))
                if not primed:
                    self._text_ends.append(total)
        self._uncounted.clear()

    async def next(self) -> generate_pb2.GenerateResponse | None:
        while not self.done:
            try:
                ev = await self.call.read()
            except grpc.aio.AioRpcError as e:
                ended = _request_ended(e)
                if await self._reattach(e.code() in REATTACH_CODES and not ended,
                                        f"{e.code().name}: {e.details()}"):
                    continue
                self.done = True
                self._ended = self._ended or ended or not self._accepted   # not accepted: nothing to detach from
                raise from_rpc_error(e, "scheduler") from None
            if ev is grpc.aio.EOF:
                if await self._reattach(True, "stream ended before Finished"):
                    continue
                self.done = True
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   "scheduler ended the stream before the request finished",
                                   err_code="backend_unavailable")
            out = self._translate(ev)
            if out is not None:
                return out
        return None

    async def _reattach(self, retryable: bool, why: str) -> bool:
        """Replace the broken scheduler call (after a pause); False when that is not allowed."""
        r = self.reattach
        if not retryable or r is None or self._closed or not self.request_id:
            return False
        delay = r.pause()
        if delay is None:
            log.warning("request %s: scheduler stream broke (%s); giving up after %d attempts",
                        self.request_id, why, r.attempts)
            return False
        log.info("request %s: scheduler stream broke (%s); reattaching in %.2fs (attempt %d)",
                 self.request_id, why, delay, r.attempts)
        await asyncio.sleep(delay)
        if not await r.wait_ready():
            log.warning("request %s: scheduler unreachable for %.1fs; giving up", self.request_id, r.budget_s)
            return False
        if self._closed:
            return False
        self.call = r.call(self.request_id, self._accepted, self._last_block)
        self._replayed_through = self._last_block
        self.reattached += 1
        return True

    def _translate(self, ev: scheduler_pb2.SchedulerEvent) -> generate_pb2.GenerateResponse | None:
        kind = ev.WhichOneof("event")
        if kind == "accepted":
            if self._accepted:   # a reattached call starts with Accepted again
                return None
            self._accepted = True
            self.request_id = self.request_id or ev.accepted.request_id
            acc = common_pb2.Accepted()
            acc.CopyFrom(ev.accepted)
            acc.prompt_tokens = acc.prompt_tokens or self.prompt_tokens
            self.detok.add_stops(acc.stop_ids)   # a Resume's detokenizer starts without them
            self.seed, self.prompt_tokens = acc.seed, acc.prompt_tokens
            return generate_pb2.GenerateResponse(accepted=acc)
        if kind == "step":
            self.timer.step(len(ev.step.tokens))
            return generate_pb2.GenerateResponse(step=ev.step)
        if kind == "block":
            b = ev.block
            if self._replayed_through is not None and b.block_index <= self._replayed_through:
                return None   # had it before the reattach
            self._last_block = b.block_index
            if self.reattach is not None:
                self.reattach.progress()
            res = self.detok.feed(b.tokens)
            primed = self.skip_through is not None and b.block_index <= self.skip_through
            self._note_tokens(res.tokens, primed)
            if primed:
                self._primed_tokens += len(res.tokens)
                return None
            if self.timer.last_block is None and trace.enabled() and self.opened_at is not None:
                trace.record("gateway", self.request_id, gw_received=trace.wall(self.timer.t0, time.perf_counter),
                             gw_submit=trace.wall(self.opened_at, time.perf_counter), gw_first_read=time.time())
            self.timer.block(len(res.tokens))
            return generate_pb2.GenerateResponse(block=generate_pb2.BlockEvent(
                block_index=b.block_index, start=b.start, tokens=res.tokens, text=res.text,
                logprobs=[b.logprobs[i] for i in res.kept] if b.logprobs else [],
                token_attributions=b.token_attributions, chunk_attributions=b.chunk_attributions))
        if kind == "finished":
            self.done = self._ended = True
            fin = common_pb2.Finished()
            fin.CopyFrom(ev.finished)
            fin.usage.prompt_tokens = fin.usage.prompt_tokens or self.prompt_tokens
            # usage counts exactly the tokens the response holds (the worker's count may include
            # ids the detokenizer drops), whatever the backend reported
            fin.usage.completion_tokens = self.response_tokens
            self.finish_reason = FINISH_REASON_TEXT.get(fin.reason, "stop")
            self.timer.finished(self.finish_reason, fin.usage, self.isd)
            return generate_pb2.GenerateResponse(finished=fin)
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"scheduler sent an unknown event {kind!r}")

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> generate_pb2.GenerateResponse:
        ev = await self.next()
        if ev is None:
            raise StopAsyncIteration
        return ev

    def finish_early(self, reason: str) -> None:
        """The front end ended the request itself (a stop string matched): record it, cancel upstream."""
        if not self.done:
            self.finish_reason = reason
            self.timer.finished(reason)
        self.close()

    def close(self) -> None:
        """Cancel the scheduler call if it is still open (idempotent; safe from finally blocks).
        Closed before the request ended, the client is gone: Detach tells the scheduler so (it
        cancels the request unless another stream is attached)."""
        if self._closed:
            return
        self._closed = True
        self.done = True
        self.timer.metrics.in_flight.labels(self.timer.metrics.model).dec()
        if not self.call.done():
            self.call.cancel()
        if not self._ended and self.on_detach is not None:
            self.on_detach(self.request_id, self.attach_id)



@dataclass
class Reattach:
    """How a `GenerationStream` gets its scheduler call back after the stream broke."""

    scheduler: object                                # SchedulerStub
    channel: grpc.aio.Channel | None                 # its channel: waited on (bounded) before a new call
    submit: scheduler_pb2.SubmitRequest | None      # None: a Resume stream (never re-Submitted)
    deadline: float | None                          # time.monotonic() the request's time runs out
    budget_s: float                                 # retrying without progress gives up after this
    attach_id: str = ""                             # the stream's id, sent again on every new call
    attempts: int = 0
    failing_since: float | None = None

    def progress(self) -> None:
        self.attempts, self.failing_since = 0, None

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def wait_ready(self) -> bool:
        """Wait (within the budget and the deadline) until the channel is connected."""
        if self.channel is None:
            return True
        start = self.failing_since if self.failing_since is not None else time.monotonic()
        wait = start + self.budget_s - time.monotonic()
        left = self.time_left()
        if left is not None:
            wait = min(wait, left)
        if wait <= 0:
            return False
        try:
            await asyncio.wait_for(self.channel.channel_ready(), wait)
            return True
        except asyncio.TimeoutError:
            return False

    def pause(self) -> float | None:
        """Seconds to wait before the next attempt; None when the budget or deadline is spent."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        first, most = REATTACH_BACKOFF_S
        delay = min(first * 2 ** self.attempts, most)
        left = self.time_left()
        if now + delay - self.failing_since > self.budget_s or (left is not None and left <= delay):
            return None
        self.attempts += 1
        return delay

    def call(self, request_id: str, accepted: bool, last_block: int | None) -> grpc.aio.UnaryStreamCall:
        left = self.time_left()
        md = attach_metadata(self.attach_id) if self.attach_id else None
        if self.submit is not None and not accepted:   # maybe never created: the same Submit is idempotent
            return self.scheduler.Submit(self.submit, timeout=left, metadata=md)
        req = common_pb2.ResumeRequest(request_id=request_id)
        if last_block is not None:
            req.after_block = last_block
        return self.scheduler.Resume(req, timeout=left, metadata=md)


def attach_metadata(attach_id: str) -> tuple[tuple[str, str], ...]:
    return ((ATTACH_MD, attach_id),)


def _request_ended(err: grpc.aio.AioRpcError) -> bool:
    try:
        return any(k == REQUEST_ENDED_MD for k, _ in (err.trailing_metadata() or ()))
    except Exception:  # noqa: BLE001 - metadata of a broken call may be unavailable
        return False

