"""Worker.Score: log-probabilities of given tokens under the served model (echo + logprobs on
/v1/completions, generated-token logprobs of a causal model, lm-eval's loglikelihood).

Causal models: exact, `cde/qwen3/loglikelihood.py` (the base model: a gated R-ISD adapter is off
outside [MASK] positions, so a plain forward is the base). Block diffusion: the public package's
lm-eval estimate (`cde/steerling/loglikelihood.py:mc_token_shares`), tokens[:score_from] the
context. Both run a dense forward of the engine's own model on one thread of their own, beside
the step thread (the engine's paged kernels and graphs are not used), at most one at a time and
at most `SCORE_QUEUE_MAX` held; no KV pages are taken.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from cde import limits as L
from cde.rpc.v1 import common_pb2
from worker_svc.validation import BadRequest


class Scorer:
    def __init__(self, model: torch.nn.Module, causal: bool, vocab_limit: int, max_context: int):
        self.model = model
        self.causal = causal
        self.vocab_limit = vocab_limit          # ids at or past it are refused (the tokenizer's range)
        self.max_context = max_context
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
        self._held = 0
        # --tensor-parallel: the forward runs on every rank between two engine steps
        # (worker_svc/tensor_parallel.py LockstepEngine.score), not on a thread of its own
        self.lockstep = None

    def check(self, req: common_pb2.ScoreRequest) -> None:
        n = len(req.tokens)
        if n == 0:
            raise BadRequest("tokens: at least one token is required")
        if n > self.max_context:
            raise BadRequest(f"tokens: {n} tokens exceed the model's context of {self.max_context}")
        bad = next((t for t in req.tokens if t >= self.vocab_limit), None)
        if bad is not None:
            raise BadRequest(f"tokens: id {bad} is outside the vocabulary (< {self.vocab_limit})")
        if not 1 <= req.score_from <= n:
            raise BadRequest(f"score_from: must be in [1, {n}] (the number of tokens), got {req.score_from}")
        if req.top_logprobs > L.TOP_LOGPROBS_MAX:
            raise BadRequest(f"top_logprobs: must be in [0, {L.TOP_LOGPROBS_MAX}], got {req.top_logprobs}")
        if req.mc_samples > L.MC_SAMPLES_MAX:
            raise BadRequest(f"mc_samples: must be in [0, {L.MC_SAMPLES_MAX}], got {req.mc_samples}")

    async def score(self, req: common_pb2.ScoreRequest) -> common_pb2.ScoreResponse:
        self.check(req)
        if self._held >= L.SCORE_QUEUE_MAX:
            raise BadRequest(f"{self._held} scoring calls are already queued here", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self._held += 1
        try:
            if self.lockstep is not None:
                return await asyncio.wrap_future(self.lockstep.score(req, self.compute))
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.compute, req)
        finally:
            self._held -= 1

    def compute(self, req: common_pb2.ScoreRequest) -> common_pb2.ScoreResponse:
        """The scoring forward of a checked request (blocking)."""
        tokens = list(req.tokens)
        out = common_pb2.ScoreResponse()
        values: list[float] = []      # full precision, for the total
        with torch.no_grad():
            if self.causal:
                from cde.qwen3.loglikelihood import token_logprobs
                for s in token_logprobs(self.model, tokens, top=req.top_logprobs)[req.score_from:]:
                    values.append(s.logprob)
                    out.scores.add(logprob=s.logprob, greedy=s.greedy, top_ids=[t for t, _ in s.top],
                                   top_logprobs=[v for _, v in s.top])
            else:
                from cde.steerling.loglikelihood import mc_token_shares
                device = next(self.model.parameters()).device
                gen = torch.Generator(device=device).manual_seed(req.seed)
                values = mc_token_shares(self.model, tokens[:req.score_from], tokens[req.score_from:],
                                         mc_num=req.mc_samples or L.DEFAULT_MC_SAMPLES,
                                         mc_batch_size=L.MC_BATCH_SIZE, generator=gen)
                for tok, share in zip(tokens[req.score_from:], values):
                    # an ELBO names no alternatives: the token alone, never "greedy" (as the package says)
                    top = ([tok], [share]) if req.top_logprobs else ([], [])
                    out.scores.add(logprob=share, greedy=False, top_ids=top[0], top_logprobs=top[1])
        out.total = float(sum(values))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
