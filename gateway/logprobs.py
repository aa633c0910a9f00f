"""OpenAI logprobs: what a request asks for (`LogprobsAsk`), the scoring calls that answer it
(`Scoring`, through the scheduler's Score to a worker) and the two response shapes.

Where the numbers come from:
* a causal model: every logprob is the base model's log-softmax (float32) at that token given
  all tokens before it, the raw distribution before temperature / top-p (vLLM's default
  "raw_logprobs"). ISD's output follows the base model exactly, so the generated tokens are
  scored after they are committed, over prompt + output so far: the same numbers a
  left-to-right sampler would have seen;
* a block-diffusion (Steerling) model: `echo` scores the prompt's continuation with the public
  package's lm-eval estimate (a Monte Carlo ELBO; `echo_context_tokens` leading tokens are the
  context, their entries null); each scored token's value is its share of the estimate, so a
  sum over the continuation is the package's loglikelihood. A generated token's logprob is the
  log-softmax over the raw logits (before repetition penalty, bans and temperature; with the
  request's steering, which acts inside the trunk) at the position and step that committed it,
  computed by the worker's sampler and carried in its block (`BlockCommitted.logprobs`): no
  Score call. It is the distribution the token was drawn from at that step, conditioned on the
  block's tokens committed before it, not a left-to-right factorisation of the text.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (the first prompt
token's logprob is null: nothing predicts it); `top_logprobs` holds the `logprobs` most likely
tokens plus the token itself, as vLLM does. Chat: `{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from cde import limits as L
from cde.rpc.v1 import common_pb2
from gateway.detok import token_text
from gateway.errors import GatewayError, from_rpc_error, invalid


@dataclass(frozen=True)
class LogprobsAsk:
    top: int                        # alternatives per token
    echo: bool                      # completions: the prompt's tokens are returned and scored
    generated: bool                 # the generated tokens' logprobs (a causal model's only)
    context_tokens: int = 0         # block diffusion + echo: the context the ELBO conditions on
    chat: bool = False
    in_band: bool = False           # block diffusion: the generated tokens' logprobs come with their blocks


def completion_ask(logprobs: int | None, echo: bool, context_tokens: int | None, causal: bool,
                   n_prompt: int) -> LogprobsAsk | None:
    """None when no logprobs are asked for (echo alone needs no scoring)."""
    if logprobs is None:
        if context_tokens is not None:
            raise invalid("echo_context_tokens applies to echo with logprobs", "echo_context_tokens")
        return None
    if not 0 <= logprobs <= L.TOP_LOGPROBS_MAX:
        raise invalid(f"logprobs must be in [0, {L.TOP_LOGPROBS_MAX}]", "logprobs")
    if causal:
        if context_tokens is not None:
            raise invalid("echo_context_tokens applies to block-diffusion models (a causal model scores "
                          "every prompt token exactly)", "echo_context_tokens")
        return LogprobsAsk(logprobs, echo, True)
    if not echo:
        if context_tokens is not None:
            raise invalid("echo_context_tokens applies to echo with logprobs", "echo_context_tokens")
        return LogprobsAsk(logprobs, False, True, in_band=True)
    if context_tokens is None:
        raise invalid("a block-diffusion model scores a continuation given a context: echo_context_tokens "
                      "(how many leading prompt tokens are the context) is required with echo and logprobs",
                      "echo_context_tokens")
    if not 1 <= context_tokens <= n_prompt:
        raise invalid(f"echo_context_tokens must be in [1, {n_prompt}] (the prompt's tokens)", "echo_context_tokens")
    return LogprobsAsk(logprobs, True, True, context_tokens, in_band=True)


def chat_ask(logprobs: bool | None, top_logprobs: int | None, causal: bool) -> LogprobsAsk | None:
    if not logprobs:
        if top_logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    top = top_logprobs or 0
    if not 0 <= top <= L.TOP_LOGPROBS_MAX:
        raise invalid(f"top_logprobs must be in [0, {L.TOP_LOGPROBS_MAX}]", "top_logprobs")
    return LogprobsAsk(top, False, True, chat=True, in_band=not causal)


@dataclass
class Entry:
    """One token of the response as logprobs show it (logprob None: not scored)."""
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def _entries(tokens: list[int], scores: list[common_pb2.TokenScore]) -> list[Entry]:
    return [Entry(t, s.logprob, tuple(zip(s.top_ids, s.top_logprobs))) for t, s in zip(tokens, scores)]


class Scoring:
    """The Score calls of one request. `prompt` as the model reads it."""

    def __init__(self, scheduler, model: str, ask: LogprobsAsk, prompt: list[int], seed: int, timeout_s: float):
        self.scheduler, self.model, self.ask = scheduler, model, ask
        self.prompt, self.seed, self.timeout_s = prompt, seed, timeout_s
        self.output: list[int] = []     # generated tokens scored so far

    async def _score(self, tokens: list[int], score_from: int) -> list[common_pb2.TokenScore]:
        req = common_pb2.ScoreRequest(model=self.model, tokens=tokens, score_from=score_from,
                                      top_logprobs=self.ask.top, seed=self.seed)
        try:
            return list((await self.scheduler.Score(req, timeout=self.timeout_s)).scores)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:   # a check only the worker could make
                raise GatewayError(e.code(), f"scoring refused: {e.details()}", param="prompt") from None
            raise from_rpc_error(e, "scheduler") from None

    async def prompt_entries(self) -> list[Entry]:
        """The echoed prompt: causal, every token after the first; block diffusion, the continuation."""
        first = self.ask.context_tokens or 1
        if first >= len(self.prompt):
            return [Entry(t) for t in self.prompt]
        scores = await self._score(self.prompt, first)
        return [Entry(t) for t in self.prompt[:first]] + _entries(self.prompt[first:], scores)

    async def response_entries(self, tokens: list[int], scores: list[common_pb2.TokenScore] = ()) -> list[Entry]:
        """A whole response's entries, the echoed prompt (if asked) then `tokens`, in one Score call
        (in band: `scores` are the generated tokens', from their blocks)."""
        if self.ask.in_band or not (self.ask.echo and self.ask.generated):
            head = await self.prompt_entries() if self.ask.echo else []
            return head + await self.output_entries(tokens, scores)
        first = min(self.ask.context_tokens or 1, len(self.prompt))
        self.output += tokens
        every = self.prompt + self.output
        scores = await self._score(every, first) if first < len(every) else []
        return [Entry(t) for t in every[:first]] + _entries(every[first:], scores)

    async def output_scores(self, tokens: list[int]) -> list[common_pb2.TokenScore]:
        """The next generated tokens' scores as the worker gives them (a causal model's; gRPC)."""
        if not tokens:
            return []
        start = len(self.prompt) + len(self.output)
        self.output += tokens
        return await self._score(self.prompt + self.output, start)

    async def output_entries(self, tokens: list[int], scores: list[common_pb2.TokenScore] = ()) -> list[Entry]:
        """The next generated tokens (after those scored before); in band, `scores` are theirs."""
        if not tokens:
            return []
        if self.ask.in_band:
            self.output += tokens
            return _entries(tokens, list(scores)[:len(tokens)])
        if not self.ask.generated:
            self.output += tokens
            return [Entry(t) for t in tokens]
        start = len(self.prompt) + len(self.output)
        self.output += tokens
        return _entries(tokens, await self._score(self.prompt + self.output, start))


# ---- response shapes --------------------------------------------------------------------------------
def _round(x: float) -> float:
    return float(f"{x:.7g}")


class Formatter:
    """Entries -> the OpenAI objects, text offsets running across the calls of one response."""

    def __init__(self, tokenizer, ask: LogprobsAsk):
        self.tok, self.ask = tokenizer, ask
        self.offset = 0

    def _text(self, token: int) -> str:
        return token_text(self.tok, token)

    def _top_dict(self, e: Entry) -> dict[str, float] | None:
        if e.logprob is None:
            return None
        out: dict[str, float] = {}
        for t, v in ((e.token, e.logprob), *e.top[:self.ask.top]):
            key = self._text(t)
            out[key] = max(out.get(key, -float("inf")), _round(v))
        return out

    def completion(self, entries: list[Entry]) -> dict[str, Any]:
        texts = [self._text(e.token) for e in entries]
        offsets = []
        for t in texts:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": texts, "token_logprobs": [None if e.logprob is None else _round(e.logprob) for e in entries],
                "top_logprobs": [self._top_dict(e) for e in entries], "text_offset": offsets}

    def chat(self, entries: list[Entry]) -> dict[str, Any]:
        def item(t: int, v: float) -> dict[str, Any]:
            s = self._text(t)
            return {"token": s, "logprob": _round(v), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**item(e.token, e.logprob if e.logprob is not None else float("nan")),
                             "top_logprobs": [item(t, v) for t, v in e.top[:self.ask.top]]} for e in entries]}

    def format(self, entries: list[Entry]) -> dict[str, Any]:
        return self.chat(entries) if self.ask.chat else self.completion(entries)
