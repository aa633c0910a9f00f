"""REST: OpenAI-compatible completions/chat with SSE, models, concept search, health, metrics.

Every error leaves as an OpenAI-style body `{"error": {message, type, param, code}}`, including
FastAPI's own validation errors, unknown routes and body-size refusals; schema/type errors keep
FastAPI's 422, out-of-range values and malformed JSON are 400 (see `_validation_status`).
Streaming waits for the scheduler's first event before sending headers, so an admission refusal
is still a real 429/404/503 and not an error event inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import grpc
from fastapi import APIRouter, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from cde import limits
from cde.rpc.v1 import common_pb2, generate_pb2, steering_pb2
from gateway.auth import ApiKeyAuth
from gateway.detok import StopStringMatcher, token_text
from gateway.errors import GatewayError, invalid, openai_error_body, utf8_safe
from gateway.metrics import CONTENT_TYPE
from gateway.choices import choice_requests, merged_batches, merged_response
from gateway.logprobs import Formatter as LogprobFormatter
from gateway.logprobs import Scoring, chat_ask, completion_ask
from gateway.pipeline import Pipeline
from gateway.resolve import Prepared
from gateway.middleware import AuthMiddleware, BodyLimitMiddleware
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    InputAttributionBody,
    TokenizeRequest,
)
from gateway.stream import GenerationStream
from gateway.ui import ui_router
from gateway.translate import (OpenAIFormatter, RestOptions, block_cde_json, chat_to_proto, completion_to_proto,
                               input_attribution_json)

log = logging.getLogger("gateway.rest")

# pydantic error types that mean "right type, bad value" (HTTP 400); all others are schema errors (422).
_VALUE_ERRORS = frozenset({
    "json_invalid", "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of",
    "finite_number", "too_short", "too_long", "string_too_short", "string_too_long", "literal_error", "enum",
    "value_error", "assertion_error"})


# ---- errors ------------------------------------------------------------------------------
# pydantic names union members in `loc` ("str", "list[constrained-int]", ...); they are not fields.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-[a-z]+|[a-z-]+\[.*\])$")


def _param(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, str) and _UNION_TAG.match(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _is_value_error(e: dict[str, Any]) -> bool:
    """A query string or path carries only text, so a parameter that does not parse ("limit=many")
    is a bad value for that field (400), like one out of range; JSON bodies have real types."""
    loc = tuple(e.get("loc", ()))
    return e["type"] in _VALUE_ERRORS or (bool(loc) and loc[0] in ("query", "path"))


def _validation_status(errors: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """400 when every offending top-level field failed on its value, else 422; plus the error to report.
    Query and path parameters are always value errors (see `_is_value_error`).

    Grouping by top-level field matters for unions (e.g. `prompt: str | list[str]`): an empty list
    fails the list branch on length (a value) and the str branch on type, and is a value error.
    """
    groups: dict[Any, list[dict[str, Any]]] = {}
    for e in errors:
        loc = tuple(e.get("loc", ()))
        groups.setdefault(loc[:2], []).append(e)
    value_groups = [g for g in groups.values() if any(_is_value_error(e) for e in g)]
    if errors and len(value_groups) == len(groups):
        return 400, next(e for e in value_groups[0] if _is_value_error(e))
    type_group = next(g for g in groups.values() if g not in value_groups)
    return 422, type_group[0]


def _json_error(status: int, message: str, param: str | None = None, code: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message, param, code), status_code=status, headers=headers)


# ---- generation ----------------------------------------------------------------------------
def _sse(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _stop_usage(stream: GenerationStream, returned_chars: int) -> common_pb2.Usage:
    """A stop string ended the request before the scheduler's Finished: stop the scheduler call
    and count the tokens of the text actually returned (`returned_chars` characters, the cut
    included), not the whole blocks streamed."""
    stream.finish_early("stop")
    return common_pb2.Usage(prompt_tokens=stream.prompt_tokens,
                            completion_tokens=stream.tokens_in_text(returned_chars))


def _error_finish(fin: common_pb2.Finished) -> GatewayError:
    return GatewayError(grpc.StatusCode.INTERNAL, f"generation failed: {fin.message or 'engine error'}",
                        err_code="generation_failed")


@dataclass
class Echo:
    """What a completion returns before its generated text and tokens: the prompt (echo), and the
    scoring that gives logprobs (None: no logprobs asked for)."""
    text: str = ""
    scoring: Scoring | None = None
    formatter: LogprobFormatter | None = None

    async def prompt_logprobs(self) -> dict[str, Any] | None:
        if self.scoring is None or not self.scoring.ask.echo:
            return None
        return self.formatter.format(await self.scoring.prompt_entries())

    async def output_logprobs(self, tokens: list[int], scores=()) -> dict[str, Any] | None:
        if self.scoring is None:
            return None
        return self.formatter.format(await self.scoring.output_entries(tokens, scores))


async def _collect(stream: GenerationStream, first: Any, fmt: OpenAIFormatter, opts: RestOptions,
                   echo: Echo) -> dict[str, Any]:
    stopper = StopStringMatcher(opts.stop_strings)
    text: list[str] = []
    tokens: list[int] = []
    scores: list[common_pb2.TokenScore] = []   # block diffusion logprobs, in band
    blocks: list[dict[str, Any]] = []
    tas: list[dict[str, Any]] = []
    cas: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    usage, reason = common_pb2.Usage(), "stop"
    ev = first
    while ev is not None:
        kind = ev.WhichOneof("event")
        if kind == "accepted":
            meta = {"request_id": ev.accepted.request_id, "seed": ev.accepted.seed}
        elif kind == "block":
            piece = stopper.feed(ev.block.text)
            text.append(piece)
            tokens += ev.block.tokens
            scores += ev.block.logprobs
            bj = block_cde_json(fmt.tokenizer, ev.block)
            tas += bj.pop("token_attributions")
            cas += bj.pop("chunk_attributions")
            blocks.append({**bj, "text": piece})
            if stopper.stopped:
                usage, reason = _stop_usage(stream, sum(map(len, text))), "stop"
                break
        elif kind == "finished":
            if ev.finished.reason == common_pb2.FINISH_REASON_ERROR:
                raise _error_finish(ev.finished)
            usage, reason = ev.finished.usage, stream.finish_reason or "stop"
        ev = await stream.next()
    text.append(stopper.flush())
    cde = {**meta, "blocks": blocks, "token_attributions": tas, "chunk_attributions": cas}
    body = fmt.response(echo.text + "".join(text), reason, usage, cde)
    if echo.scoring is not None:
        body["choices"][0]["logprobs"] = echo.formatter.format(
            await echo.scoring.response_entries(tokens[:usage.completion_tokens], scores))
    return body


async def _sse_batches(stream: GenerationStream, first: Any, fmt: OpenAIFormatter, opts: RestOptions,
                       on_error: Callable[[int], None], echo: Echo) -> AsyncIterator[tuple[list[dict[str, Any]], bool]]:
    """One choice's SSE objects in batches, each (objects ready together, is it the last): the
    next batch needs a wait. An error after the headers are out is the last batch's in-band error."""
    stopper = StopStringMatcher(opts.stop_strings)
    sent_chars = 0   # of the response text, for usage after a stop string
    sent_tokens = 0  # of its tokens, for logprobs after a stop string
    out: list[dict[str, Any]] = []
    try:
        ev = first
        while ev is not None:
            kind = ev.WhichOneof("event")
            if kind == "accepted":
                out.append(fmt.accepted_chunk(ev.accepted))
                if echo.text or echo.scoring is not None and echo.scoring.ask.echo:
                    out.append(_with_logprobs(fmt.text_chunk(echo.text), await echo.prompt_logprobs()))
            elif kind == "step":
                if opts.steps:
                    out.append(fmt.step_chunk(ev.step))
            elif kind == "block":
                piece = stopper.feed(ev.block.text)
                sent_chars += len(piece)
                tokens = list(ev.block.tokens)
                usage = _stop_usage(stream, sent_chars) if stopper.stopped else None
                if usage is not None:
                    tokens = tokens[:max(0, usage.completion_tokens - sent_tokens)]
                sent_tokens += len(tokens)
                out.append(_with_logprobs(fmt.block_chunk(ev.block, piece),
                                          await echo.output_logprobs(tokens, ev.block.logprobs)))
                if usage is not None:
                    out.append(fmt.final_chunk("stop"))
                    if opts.include_usage:
                        out.append(fmt.usage_chunk(usage))
                    break
            elif kind == "finished":
                tail = stopper.flush()
                if tail:
                    out.append(fmt.text_chunk(tail))
                if ev.finished.reason == common_pb2.FINISH_REASON_ERROR:
                    raise _error_finish(ev.finished)
                out.append(fmt.final_chunk(stream.finish_reason or "stop"))
                if opts.include_usage:
                    out.append(fmt.usage_chunk(ev.finished.usage))
            if out and not stream.done:   # the next event needs a wait: send what is ready first
                yield out, False
                out = []
            ev = await stream.next()
    except GatewayError as e:  # headers are out: report in-band, like OpenAI does
        on_error(e.http_status)
        out.append(e.body())
    finally:
        stream.close()  # client gone or done: cancels the scheduler call if still open
    yield out, True


async def _sse_events(batches: AsyncIterator[tuple[list[dict[str, Any]], bool]]) -> AsyncIterator[str]:
    """The response's SSE body. Events that are ready together go out as one body chunk (one
    socket write): a request's end (final chunk, usage, [DONE]) is one write, not three, which
    counts when a burst of requests ends in the same engine step."""
    async for batch, last in batches:
        body = "".join(_sse(o) for o in batch)
        if last:
            yield body + "data: [DONE]\n\n"
            return
        yield body


def _with_logprobs(chunk: dict[str, Any], logprobs: dict[str, Any] | None) -> dict[str, Any]:
    if logprobs is not None:
        chunk["choices"][0]["logprobs"] = logprobs
    return chunk


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


router = APIRouter()


def _pipeline(request: Request) -> Pipeline:
    # Routes are module-level and read their state from the app, not from closures: FastAPI caches
    # endpoint callables process-wide, and a closure would pin the pipeline (and its gRPC channels).
    return request.app.state.pipeline


# ---- error handlers (module-level for the same reason) ----
async def _on_gateway_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, GatewayError)
    _pipeline(request).metrics.failed(e.http_status)
    return JSONResponse(e.body(), status_code=e.http_status, headers=e.http_headers())


async def _on_validation_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, RequestValidationError)
    status, err = _validation_status(list(e.errors()))
    _pipeline(request).metrics.failed(status)
    param = _param(tuple(err.get("loc", ())))
    if tuple(err.get("loc", ())) == ("body",) and err["type"] == "missing":
        return _json_error(400, "the request body is empty: this endpoint takes a JSON object", "body", "missing_body")
    if err["type"] == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return _json_error(status, f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json")
    msg = err.get("msg", "invalid value")
    return _json_error(status, f"{param}: {msg}" if param else msg, param,
                       "invalid_value" if status == 400 else "invalid_type")


async def _on_http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, StarletteHTTPException)
    _pipeline(request).metrics.failed(e.status_code)
    return _json_error(e.status_code, str(e.detail), headers=getattr(e, "headers", None))


async def _on_internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=e)
    _pipeline(request).metrics.failed(500)
    return _json_error(500, "internal error in the gateway", code="internal_error")


# ---- generation ----
async def _generate(request: Request, body: GenerationFields,
                    translated: tuple[generate_pb2.GenerateRequest, RestOptions]) -> Response:
    pipeline = _pipeline(request)
    bad = body.unsupported()
    if bad is not None:
        raise invalid(bad[1], bad[0], "unsupported")
    greq, opts = translated
    timer = pipeline.metrics.request()
    prepared = await pipeline.prepare(greq)
    runs = [(p, _echo(pipeline, body, greq, p)) for p in choice_requests(prepared, body.n)]
    streams = [pipeline.open(p, timer if i == 0 else None) for i, (p, _) in enumerate(runs)]
    try:
        firsts = [await s.next() for s in streams]
    except BaseException:
        for s in streams:
            s.close()
        raise
    model = pipeline.model
    fmts = [OpenAIFormatter(model.tokenizer, model.id, p.submit.request_id, opts.chat, opts.include_usage,
                            isd=model.causal) for p, _ in runs]

    def close_all() -> None:
        for s in streams:
            s.close()

    if opts.stream:
        gens = [_sse_batches(s, f, fmt, opts, pipeline.metrics.failed, echo)
                for s, f, fmt, (_, echo) in zip(streams, firsts, fmts, runs)]

        async def close() -> None:  # also runs when the client left before the body started
            close_all()
        return StreamingResponse(_sse_events(gens[0] if len(gens) == 1 else merged_batches(gens, opts.include_usage, fmts[0].id)),
                                 media_type="text/event-stream", background=BackgroundTask(close),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collector = asyncio.ensure_future(asyncio.gather(*(
        _collect(s, f, fmt, opts, echo) for s, f, fmt, (_, echo) in zip(streams, firsts, fmts, runs))))
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # client left: stop generating for nobody
            collector.cancel()
            return Response(status_code=499)
        bodies = collector.result()
        return JSONResponse(bodies[0] if len(bodies) == 1 else merged_response(bodies))
    finally:
        watcher.cancel()
        close_all()


def _echo(pipeline: Pipeline, body: GenerationFields, greq: generate_pb2.GenerateRequest, prepared: Prepared) -> Echo:
    """The request's echo and logprobs, checked (400 naming the field) before it is submitted."""
    model = pipeline.model
    prompt = list(prepared.submit.prompt_tokens)
    if isinstance(body, CompletionRequest):
        ask = completion_ask(body.logprobs, body.echo, body.echo_context_tokens, model.causal, len(prompt))
        text = ""
        if body.echo:
            text = greq.prompt if greq.WhichOneof("input") == "prompt" else \
                model.tokenizer.decode(prompt, skip_special=False)
    else:
        assert isinstance(body, ChatCompletionRequest)
        ask, text = chat_ask(body.logprobs, body.top_logprobs, model.causal), ""
    if ask is None:
        return Echo(text)
    if ask.in_band:   # the worker's sampler records them (block diffusion)
        prepared.submit.top_logprobs = ask.top
    return Echo(text, pipeline.scoring(ask, prepared), LogprobFormatter(model.tokenizer, ask))


@router.post("/v1/completions", tags=["generation"])
async def completions(request: Request, body: CompletionRequest) -> Response:
    """Text completion (OpenAI). `stream: true` answers with SSE chunks ending in `data: [DONE]`."""
    return await _generate(request, body, completion_to_proto(body))


@router.post("/v1/chat/completions", tags=["generation"])
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    """Chat completion (OpenAI); the model's chat template is applied to `messages`."""
    return await _generate(request, body, chat_to_proto(body))


_ID_PREFIXES = ("chatcmpl-", "cmpl-")


@router.post("/v1/attributions/inputs", tags=["attribution"])
async def input_attributions(request: Request, body: InputAttributionBody) -> Response:
    """Which prompt and earlier generated tokens made the model commit tokens of a finished
    block-diffusion request: integrated gradients from a MASK baseline on the exact partially masked
    input of the step that committed each token (the public package's faithful diffusion replay;
    steered requests replay their injection), computed by the attribution tier from the stored
    request. JSON `{"request_id", "n_steps", "targets": [...], "summary"}`; `stream: true` sends
    progress events, each target and the summary as SSE, then `[DONE]`."""
    pipeline = _pipeline(request)
    rid = body.request_id
    for prefix in _ID_PREFIXES:
        if rid.startswith(prefix):
            rid = rid[len(prefix):]
            break
    req = common_pb2.InputAttributionRequest(request_id=rid, positions=body.positions or [],
                                             n_steps=body.n_steps or 0)
    if body.chunk is not None:
        if body.positions:
            raise invalid("give positions or chunk, not both", "chunk")
        if body.chunk.end <= body.chunk.start:
            raise invalid("chunk.end must be greater than chunk.start", "chunk.end")
        req.chunk_start, req.chunk_end = body.chunk.start, body.chunk.end
    tok = pipeline.model.tokenizer
    events = pipeline.attribute_inputs(req)
    if body.stream:
        first = await anext(events)   # errors before the stream starts are answered as HTTP errors

        async def sse() -> AsyncIterator[str]:
            yield _sse(input_attribution_json(tok, first))
            async for ev in events:
                yield _sse(input_attribution_json(tok, ev))
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    targets, summary = [], None
    async for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "target":
            targets.append(input_attribution_json(tok, ev))
        elif kind == "summary":
            summary = input_attribution_json(tok, ev)
    for t in targets:
        t.pop("object")
    if summary is not None:
        summary.pop("object")
    return JSONResponse({"object": "cde.input_attribution", "request_id": rid,
                         "n_steps": summary["n_steps"] if summary else body.n_steps, "targets": targets,
                         "summary": summary})


@router.post("/v1/requests/{request_id}/cancel", tags=["generation"])
async def cancel(request: Request, request_id: str) -> dict[str, Any]:
    """Cancel a running generation by its id (the part after `cmpl-`/`chatcmpl-`)."""
    resp = await _pipeline(request).cancel(request_id)
    return {"id": request_id, "cancelled": resp.cancelled}


# ---- tokenizer (vLLM's endpoints: lm-eval's "remote" tokenizer backend uses them) ----
def _eos_id(tok: Any) -> int:
    return tok.eos_id if hasattr(tok, "eos_id") else min(tok.stop_ids)


@router.get("/tokenizer_info", tags=["tokenizer"])
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The served tokenizer's special tokens and context (their spellings; text never encodes to
    a special id here, so a client wanting an id reads it from `eos_token_id`)."""
    model = _pipeline(request).model
    tok = model.tokenizer
    eos = _eos_id(tok)
    bos = tok.bos_id if tok.bos_id >= 0 else None
    return {"tokenizer_class": type(tok).__name__, "model_max_length": model.max_context,
            "eos_token": token_text(tok, eos), "eos_token_id": eos,
            "bos_token": token_text(tok, bos) if bos is not None else None, "bos_token_id": bos,
            "pad_token": token_text(tok, tok.pad_id) if tok.pad_id >= 0 else None, "chat_template": None}


@router.post("/tokenize", tags=["tokenizer"])
async def tokenize(request: Request, body: TokenizeRequest) -> dict[str, Any]:
    """Text -> the token ids a text prompt becomes (special spellings stay text, as in a prompt);
    or `messages` -> the chat template's ids."""
    pipeline = _pipeline(request)
    pipeline.check_model(body.model or "")
    tok = pipeline.model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise invalid("exactly one of prompt or messages is required", "prompt")
    if body.prompt is not None:
        ids = tok.encode(utf8_safe(body.prompt))
    else:
        try:
            ids = tok.apply_chat_template([{"role": "system" if m.role == "developer" else m.role,
                                            "content": utf8_safe(m.text())} for m in body.messages],
                                          add_generation_prompt=body.add_generation_prompt)
        except ValueError as e:
            raise invalid(str(e), "messages") from None
    return {"count": len(ids), "max_model_len": pipeline.model.max_context, "tokens": ids}


@router.post("/detokenize", tags=["tokenizer"])
async def detokenize(request: Request, body: DetokenizeRequest) -> dict[str, Any]:
    """Token ids -> text (special tokens spelled out)."""
    pipeline = _pipeline(request)
    pipeline.check_model(body.model or "")
    tok = pipeline.model.tokenizer
    bad = next((i for i, t in enumerate(body.tokens) if t >= tok.vocab_size), None)
    if bad is not None:
        raise invalid(f"tokens[{bad}]: id {body.tokens[bad]} is outside the vocabulary (< {tok.vocab_size})",
                      f"tokens[{bad}]")
    return {"prompt": tok.decode(body.tokens, skip_special=False)}


# ---- catalog ----
def _model_json(pipeline: Pipeline) -> dict[str, Any]:
    model = pipeline.model
    info = model.info()
    return {"id": model.id, "object": "model", "created": model.created, "owned_by": "cde",
            "cde": {"family": info.family, "diffusion_block_size": info.diffusion_block_size,
                    "max_context": info.max_context, "n_known_concepts": info.n_known_concepts,
                    "n_discovered_concepts": info.n_discovered_concepts}}


@router.get("/v1/models", tags=["catalog"])
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_json(_pipeline(request))]}


@router.get("/v1/models/{model_id:path}", tags=["catalog"])
async def get_model(request: Request, model_id: str) -> dict[str, Any]:
    pipeline = _pipeline(request)
    pipeline.check_model(model_id)
    return _model_json(pipeline)


def _concept_json(c: common_pb2.Concept) -> dict[str, Any]:
    return {"id": c.id, "object": "concept", "name": c.name, "head": c.head, "description": c.description,
            "group_id": c.group_id if c.HasField("group_id") else None, "group_name": c.group_name,
            "steerable": c.steerable}


_LISTING_ONLY = ("after", "group", "steerable")   # listing parameters a search (q) does not take


@router.get("/v1/concepts", tags=["catalog"])
async def concepts(
    request: Request,
    q: Annotated[str | None, Query(max_length=limits.SEARCH_QUERY_MAX_CHARS, description=(
        "search names, then descriptions (case-insensitive substring; exact names first); "
        "without q the catalog is listed in id order"))] = None,
    limit: Annotated[int | None, Query(ge=1, le=limits.LIST_LIMIT_MAX, description=(
        f"listing: [1, {limits.LIST_LIMIT_MAX}], default {limits.DEFAULT_LIST_LIMIT}; "
        f"search: [1, {limits.SEARCH_LIMIT_MAX}], default {limits.DEFAULT_SEARCH_LIMIT}"))] = None,
    after: Annotated[int | None, Query(ge=0, le=limits.U32_MAX, description=(
        "listing: only ids greater than this (the previous page's next_after)"))] = None,
    head: Annotated[Literal["known", "discovered"] | None, Query(description="only this head")] = None,
    group: Annotated[int | None, Query(ge=0, le=limits.U32_MAX, description="listing: only this group_id")] = None,
    steerable: Annotated[bool | None, Query(description="listing: only (non-)steerable concepts")] = None,
    known_only: Annotated[bool, Query(description="search: known concepts only (same as head=known)")] = False,
) -> dict[str, Any]:
    """The concept catalog (ids and names for `steering.concepts[]`).

    Without `q`: one page in id order, `{"object": "list", "data", "has_more", "next_after"}`;
    pass `next_after` as `after` for the next page. With `q`: search results, `{"object": "list", "data"}`.
    """
    pipeline = _pipeline(request)
    if q is not None:
        given = {"after": after, "group": group, "steerable": steerable}
        extra = next((name for name in _LISTING_ONLY if given[name] is not None), None)
        if extra is not None:
            raise invalid(f"{extra} applies to listing the catalog (without q), not to search", extra)
        if head == "discovered":
            raise invalid("search takes head=known (known concepts only) or no head", "head")
        n = limit or limits.DEFAULT_SEARCH_LIMIT
        if n > limits.SEARCH_LIMIT_MAX:   # before it goes into a uint32 proto field
            raise invalid(f"limit must be in [1, {limits.SEARCH_LIMIT_MAX}] for a search", "limit")
        resp = await pipeline.search_concepts(common_pb2.SearchConceptsRequest(
            query=q, limit=n, known_only=known_only or head == "known"))
        return {"object": "list", "data": [_concept_json(c) for c in resp.concepts]}
    if known_only:
        head = "known"
    req = steering_pb2.ListConceptsRequest(limit=limit or limits.DEFAULT_LIST_LIMIT, head=head or "")
    if after is not None:
        req.after = after
    if group is not None:
        req.group_id = group
    if steerable is not None:
        req.steerable = steerable
    page = await pipeline.list_concepts(req)
    data = [_concept_json(c) for c in page.concepts]
    return {"object": "list", "data": data, "has_more": page.has_more,
            "next_after": data[-1]["id"] if page.has_more and data else None}


@router.get("/v1/concepts/{concept_id}", tags=["catalog"])
async def concept(
    request: Request,
    concept_id: Annotated[int, Path(ge=0, le=limits.U32_MAX, description="the concept's id")],
    top_tokens: Annotated[int, Query(ge=0, le=limits.TOP_TOKENS_MAX, description=(
        f"how many of the tokens the concept promotes most to return, [0, {limits.TOP_TOKENS_MAX}]"))]
        = limits.DEFAULT_TOP_TOKENS,
) -> dict[str, Any]:
    """One concept plus `top_tokens`: the vocabulary tokens its unit embedding scores highest on
    through the LM head (`[{"token_id", "text", "score"}]`, best first), the check of what steering
    toward it promotes. 404 for an unknown id."""
    pipeline = _pipeline(request)
    detail = await pipeline.describe_concept(concept_id, top_tokens)
    tok = pipeline.model.tokenizer
    return {**_concept_json(detail.concept),
            "top_tokens": [{"token_id": t.token_id, "text": token_text(tok, t.token_id), "score": round(t.score, 6)}
                           for t in detail.top_tokens]}


# ---- operations ----
@router.get("/health", tags=["operations"])
async def health(request: Request) -> JSONResponse:
    """200 when scheduler, steering and at least one worker are SERVING; else 503 naming the stage."""
    pipeline = _pipeline(request)
    r = await pipeline.backends.readiness(request.app.state.readiness_timeout_s)
    pipeline.metrics.update_from_stats(r.stats)
    body: dict[str, Any] = {"status": "ok" if r.ready else "unavailable", "model": pipeline.model.id,
                            "stages": r.stages}
    if not r.ready:
        waiting = [k for k, v in r.stages.items() if v != "SERVING"]
        body["error"] = openai_error_body(503, f"not ready: {', '.join(waiting)}", None, "backend_unavailable")["error"]
    return JSONResponse(body, status_code=200 if r.ready else 503)


@router.get("/metrics", tags=["operations"])
async def prometheus(request: Request) -> Response:
    """Prometheus text: gateway latencies/counters plus scheduler gauges fetched now."""
    pipeline = _pipeline(request)
    pipeline.metrics.update_from_stats(await pipeline.backends.stats(request.app.state.readiness_timeout_s))
    return Response(pipeline.metrics.render(), media_type=CONTENT_TYPE)


def build_app(pipeline: Pipeline, *, auth: ApiKeyAuth | None = None,
              max_body_bytes: int = limits.MAX_BODY_BYTES, readiness_timeout_s: float = 1.0) -> FastAPI:
    """The REST app. `pipeline` carries the model, backends, limits and metrics."""
    app = FastAPI(title="cde gateway", version="1",
                  description="OpenAI-compatible API for interpretable, steerable block-diffusion generation. "
                              "Extensions: steering, attribution, decode, sampling, stream_mode, stop_token_ids.")
    app.state.pipeline = pipeline
    app.state.readiness_timeout_s = readiness_timeout_s
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_internal_error)
    app.include_router(router)
    app.include_router(ui_router())   # the live view at /ui, linked from /
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_error=pipeline.metrics.failed)
    # outermost: keys are checked before the body is even read
    app.add_middleware(AuthMiddleware, auth=auth or ApiKeyAuth(()), on_error=pipeline.metrics.failed)
    return app
