"""Structured output on the worker: a request's grammar (WorkerSubmit.grammar, compiled by the
gateway from its response_format) -> a `cde.grammar.Constraint` over this model's vocabulary,
which is built once, on the first request that has a grammar. A grammar that does not compile
is INVALID_ARGUMENT (BadRequest) before the request costs a step. `attach` puts it on a Job in
the state after the job's committed tokens (the engines take it as it is)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from worker_svc.engine.job import Job
from worker_svc.validation import BadRequest

MAX_GRAMMAR_CHARS = 1 << 20   # a compiled grammar (the gateway bounds the schema / regex it comes from)


class Grammars:
    def __init__(self, build_vocabulary: Callable[[], object] | None):
        self._build = build_vocabulary     # None: this model serves no structured output
        self._vocab = None

    def constraint(self, grammar: str):
        from cde.grammar import GrammarError
        if self._build is None:
            raise BadRequest("structured output needs the model's tokenizer and an end token")
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise BadRequest(f"grammar: {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self._vocab is None:
            try:
                self._vocab = self._build()
            except ValueError as e:   # e.g. a tokenizer that is not byte-level
                raise BadRequest(f"structured output is not available for this model: {e}") from None
        try:
            return self._vocab.constraint(grammar)
        except GrammarError as e:
            raise BadRequest(f"grammar: {e.message}") from None

    def attach(self, job: Job, grammar: str) -> Job:
        """`job` with its grammar's Constraint, advanced through the tokens it already committed (a
        request resumed after a lost worker); unchanged without a grammar."""
        if not grammar:
            return job
        constraint = self.constraint(grammar)
        for t in job.committed:
            try:
                constraint.advance(t)
            except ValueError:
                raise BadRequest("committed_tokens do not match the request's grammar") from None
        return dataclasses.replace(job, constraint=constraint)
