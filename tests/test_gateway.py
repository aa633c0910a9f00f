"""Gateway tests: REST (OpenAI-compatible) + public gRPC against in-test fake backends.

The real scheduler and steering services are separate processes; here small grpc.aio fakes
implementing their protos run on loopback (port 0) in a background event loop, together with the
gateway itself (real uvicorn + grpc.aio). Tests talk to it over real sockets with httpx, the
unmodified `openai` client and a gRPC channel.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from cde.rpc import make_server, service_name
from cde.rpc.v1 import (common_pb2, generate_pb2, generate_pb2_grpc, resolved_pb2, scheduler_pb2, scheduler_pb2_grpc,
                        steering_pb2, steering_pb2_grpc)
from cde.steerling.tokenizer import ByteTokenizer
from gateway.app import _validation_status
from gateway.auth import ApiKeyAuth, TokenBucket
from gateway.detok import BlockDetokenizer, StopStringMatcher
from gateway.errors import GatewayError
from gateway.server import GatewayHandle, GatewaySettings, serve

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "steerling-tiny"
MODEL = "steerling-tiny"
EOS, MASK = 256, 260
# Two committed blocks whose byte tokens split the 2-byte "é" (c3 a9) across the block edge.
BLOCKS = [list(b"Hello, caf\xc3"), list(b"\xa9!") + [EOS] * 3 + [MASK]]
TEXT = "Hello, café!"
N_OUT = 13  # output tokens: 11 + 2


# ---- fakes --------------------------------------------------------------------------------
def _score(cid: int, name: str, score: float) -> common_pb2.ConceptScore:
    return common_pb2.ConceptScore(concept_id=cid, label=f"Known: {name}", head="known", score=score)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Accepted, two BlockCommitted with attributions, Finished; or a refusal, per `mode`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.mode = "ok"  # ok | exhausted | not_found | slow | error
        self.workers = 1
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.attach_ids: list[str] = []   # each Submit's cde-attach-id metadata
        self.detaches: list[scheduler_pb2.DetachRequest] = []
        self.cancelled = threading.Event()
        self.detached = threading.Event()

    async def Submit(self, request, context):
        self.submits.append(request)
        self.attach_ids.append(dict(context.invocation_metadata() or ()).get("cde-attach-id", ""))
        if self.mode == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full",
                                trailing_metadata=(("retry-after-ms", "1500"),))
        if self.mode == "not_found":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker serves model {request.model!r}")
        n = len(request.prompt_tokens)
        try:
            yield scheduler_pb2.SchedulerEvent(accepted=common_pb2.Accepted(
                request_id=request.request_id, prompt_tokens=n, seed=request.options.seed))
            start = n
            for i, toks in enumerate(BLOCKS):
                if i and self.mode == "slow":
                    await asyncio.sleep(30)
                if request.stream_steps:
                    yield scheduler_pb2.SchedulerEvent(step=common_pb2.StepEvent(
                        step=i, block_index=start // 64, positions=[start], tokens=[toks[0]]))
                tas = [common_pb2.TokenAttribution(position=start + j, token=t, target_logit=2.0, residual=0.5,
                                                   top=[_score(0, "ocean", 1.5)]) for j, t in enumerate(toks[:2])]
                cas = [common_pb2.ChunkAttribution(start=start, end=start + len(toks), residual_pct=10.0,
                                                   top=[_score(1, "river", 0.9)])]
                yield scheduler_pb2.SchedulerEvent(block=common_pb2.BlockCommitted(
                    block_index=start // 64, start=start, tokens=toks, token_attributions=tas, chunk_attributions=cas))
                start += len(toks)
            if self.mode == "error":
                yield scheduler_pb2.SchedulerEvent(finished=common_pb2.Finished(
                    reason=common_pb2.FINISH_REASON_ERROR, message="engine exploded"))
                return
            yield scheduler_pb2.SchedulerEvent(finished=common_pb2.Finished(
                reason=common_pb2.FINISH_REASON_STOP,
                # more than the blocks hold (a worker counting ids the detokenizer drops): the
                # gateway's usage counts the tokens its response holds, N_OUT
                usage=common_pb2.Usage(prompt_tokens=n, completion_tokens=48, steps=N_OUT, forwards=N_OUT,
                                       tokens_per_forward=1.0)))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Resume(self, request, context):
        yield scheduler_pb2.SchedulerEvent(accepted=common_pb2.Accepted(request_id=request.request_id, seed=5))
        after = request.after_block if request.HasField("after_block") else -1
        if after < 0:
            yield scheduler_pb2.SchedulerEvent(block=common_pb2.BlockCommitted(block_index=0, start=2, tokens=BLOCKS[0]))
        yield scheduler_pb2.SchedulerEvent(block=common_pb2.BlockCommitted(block_index=1, start=64, tokens=BLOCKS[1]))
        yield scheduler_pb2.SchedulerEvent(finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP))

    async def Cancel(self, request, context):
        return common_pb2.CancelResponse(cancelled=True)

    async def Detach(self, request, context):
        self.detaches.append(request)
        self.detached.set()
        return common_pb2.CancelResponse(cancelled=True)

    async def Stats(self, request, context):
        workers = [scheduler_pb2.WorkerInfo(worker_id=f"w{i}", model=MODEL, kv_pages_total=100, kv_pages_free=75)
                   for i in range(self.workers)]
        return scheduler_pb2.StatsResponse(running=1, waiting=2, workers=workers)


CONCEPTS = [common_pb2.Concept(id=0, name="ocean", head="known", steerable=True),
            common_pb2.Concept(id=1, name="river", head="known", steerable=True, group_id=3, group_name="water")]


class FakeSteering(steering_pb2_grpc.SteeringServicer):
    def __init__(self) -> None:
        self.builds: list[steering_pb2.BuildSteeringRequest] = []

    async def SearchConcepts(self, request, context):
        hits = [c for c in CONCEPTS if request.query.lower() in c.name]
        return common_pb2.SearchConceptsResponse(concepts=hits[: request.limit or 20])

    async def BuildSteering(self, request, context):
        self.builds.append(request)
        ids = []
        for c in request.steering.concepts:
            if c.WhichOneof("ref") == "name":
                hit = next((x for x in CONCEPTS if x.name == c.name.lower()), None)
                if hit is None:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown concept name {c.name!r}")
                ids.append(hit.id)
            else:
                if c.concept_id >= 144:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown concept id {c.concept_id}")
                ids.append(c.concept_id)
        return common_pb2.PreparedSteering(direction_f32=b"\0" * 512, base_alpha=8.0, inject_layer=2,
                                           schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF, cutoff_tokens=32,
                                           concept_ids=ids, model=request.model)


class Stack:
    """A background event loop running the fakes and any number of gateways."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.scheduler, self.steering = FakeScheduler(), FakeSteering()
        self.gateways: list[GatewayHandle] = []
        self.run(self._start_fakes())

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_fakes(self) -> None:
        self.sched_server, self.sched_health = await make_server([service_name(scheduler_pb2, "Scheduler")])
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.scheduler, self.sched_server)
        self.sched_port = self.sched_server.add_insecure_port("127.0.0.1:0")
        self.steer_server, self.steer_health = await make_server([service_name(steering_pb2, "Steering")])
        steering_pb2_grpc.add_SteeringServicer_to_server(self.steering, self.steer_server)
        self.steer_port = self.steer_server.add_insecure_port("127.0.0.1:0")
        for server, health in ((self.sched_server, self.sched_health), (self.steer_server, self.steer_health)):
            await server.start()
            await health.set_serving(True)

    def gateway(self, **overrides: Any) -> GatewayHandle:
        settings = GatewaySettings(model_dir=str(MODEL_DIR), http_port=0, grpc_port=0,
                                   scheduler=f"127.0.0.1:{self.sched_port}", steering=f"127.0.0.1:{self.steer_port}",
                                   log_level="warning", health_interval_s=0.1)
        for k, v in overrides.items():
            setattr(settings, k, v)
        handle = self.run(serve(settings))
        self.gateways.append(handle)
        return handle

    def close(self) -> None:
        async def stop() -> None:
            for g in self.gateways:
                await g.stop(0.5)
            await self.sched_server.stop(0)
            await self.steer_server.stop(0)
            self.gateways.clear()
        self.run(stop())
        self.run(self.loop.shutdown_asyncgens())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.close()


@pytest.fixture(scope="module")
def gw(stack: Stack) -> GatewayHandle:
    return stack.gateway()


@pytest.fixture
def client(gw: GatewayHandle, stack: Stack) -> Iterator[httpx.Client]:
    stack.scheduler.reset()
    stack.steering.builds.clear()
    with httpx.Client(base_url=gw.base_url, timeout=10) as c:
        yield c
    stack.scheduler.reset()


def sse_frames(raw: str) -> list[str]:
    """Split an SSE body into the `data:` payloads, checking the framing on the way."""
    assert raw.endswith("\n\n"), raw[-50:]
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[len("data: "):] for f in frames]


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def completion(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 16, **body})


# ---- units --------------------------------------------------------------------------------
def test_detokenizer_keeps_characters_split_across_blocks() -> None:
    d = BlockDetokenizer(ByteTokenizer())
    first, second = d.feed(BLOCKS[0]), d.feed(BLOCKS[1])
    assert (first.text, second.text) == ("Hello, caf", "é!")
    assert second.tokens == list(b"\xa9!") and second.stopped  # EOS ends it, mask ids are dropped
    assert d.feed(list(b"more")).text == "" and d.n_tokens == N_OUT


def test_detokenizer_request_stop_ids_and_skipped_specials() -> None:
    tok = ByteTokenizer()
    d = BlockDetokenizer(tok, extra_stop_ids=[ord("x")])
    r = d.feed([MASK, ord("a"), tok.endofchunk_id, ord("b"), ord("x"), ord("c")])
    assert r.text == "ab" and r.tokens == [ord("a"), tok.endofchunk_id, ord("b")] and r.stopped


def test_stop_string_matcher_holds_back_possible_prefixes() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abc E") == "abc " and m.feed("N") == "" and m.feed("x") == "ENx"
    assert m.feed("yyEND zzz") == "yy" and m.stopped and m.feed("more") == "" and m.flush() == ""
    m2 = StopStringMatcher(["END"])
    assert m2.feed("tail E") == "tail " and m2.flush() == "E"


def test_validation_errors_are_split_into_value_and_type() -> None:
    value = [{"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "x"}]
    union_empty = [{"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "x"},
                   {"type": "too_short", "loc": ("body", "prompt", "list[str]"), "msg": "x"}]
    typ = [{"type": "float_parsing", "loc": ("body", "temperature"), "msg": "x"}]
    assert _validation_status(value)[0] == 400 and _validation_status(union_empty)[0] == 400
    assert _validation_status(typ)[0] == 422 and _validation_status(value + typ)[0] == 422
    query = [{"type": "int_parsing", "loc": ("query", "limit"), "msg": "x"}]
    assert _validation_status(query)[0] == 400 and _validation_status(query + typ)[0] == 422


def test_api_keys_and_token_bucket() -> None:
    auth = ApiKeyAuth(["k1"], rate_per_min=1)
    with pytest.raises(GatewayError) as e:
        auth.check("Bearer nope")
    assert e.value.http_status == 401
    assert auth.check("Bearer k1") == "k1"
    with pytest.raises(GatewayError) as e:
        auth.check("bearer k1")
    assert e.value.http_status == 429 and int(e.value.http_headers()["Retry-After"]) >= 1
    assert ApiKeyAuth([]).check(None) is None
    assert TokenBucket(60).take() == 0.0


def test_gateway_sampling_defaults_match_the_model_sampler() -> None:
    from cde.steerling.sampling import SamplingParams
    from gateway.resolve import Limits, ModelCard, RequestResolver
    got = RequestResolver(ModelCard.load(MODEL_DIR), None, Limits()).resolve_sampling(common_pb2.SamplingOptions())
    p = SamplingParams()
    assert (got.use_entropy_sampling, got.temperature, got.top_p, got.repetition_penalty) == pytest.approx(
        (p.use_entropy_sampling, p.temperature, p.top_p, p.repetition_penalty))


# ---- REST: generation ----------------------------------------------------------------------
@pytest.mark.e2e
def test_completion_non_stream_resolves_every_option(client: httpx.Client, stack: Stack) -> None:
    r = completion(client, attribution="all", attribution_top_k=4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": N_OUT, "total_tokens": 2 + N_OUT}
    cde = body["cde"]
    assert [b["text"] for b in cde["blocks"]] == ["Hello, caf", "é!"]
    assert cde["blocks"][1]["tokens"] == list(b"\xa9!")
    ta = cde["token_attributions"][0]
    assert ta == {"position": 2, "commit_order": 0, "token": ord("H"), "text": "H", "target_logit": 2.0, "residual": 0.5,
                  "top": [{"concept_id": 0, "label": "Known: ocean", "score": 1.5, "head": "known"}],
                  "other": {"known": 0.0, "discovered": 0.0}}
    assert len(cde["chunk_attributions"]) == 2 and cde["chunk_attributions"][0]["top"][0]["label"] == "Known: river"
    (sub,) = stack.scheduler.submits
    assert list(sub.prompt_tokens) == list(b"Hi") and sub.model == MODEL and sub.request_id in body["id"]
    # every sampling field resolved: the Steerling defaults, exactly (no field left for the worker)
    assert sub.options.sampling == resolved_pb2.ResolvedSampling(use_entropy_sampling=True, temperature=1.2,
                                                                 top_p=0.8, repetition_penalty=1.1)
    opts = sub.options
    assert opts.sampling.use_entropy_sampling and opts.max_new_tokens == 16 and opts.block_diffusion.tokens_per_step == 1
    assert sub.HasField("options") and 0 <= opts.seed < 2**63 and cde["seed"] == opts.seed
    assert sub.attribution == common_pb2.ATTRIBUTION_ALL and sub.attribution_top_k == 4
    assert not sub.HasField("steering")


@pytest.mark.e2e
def test_openai_sampling_fields_map_onto_steerling_options(client: httpx.Client, stack: Stack) -> None:
    assert completion(client, temperature=0.5, top_p=0.9, seed=7,
                      decode={"tokens_per_step": 4, "threshold": 0.9}).status_code == 200
    assert completion(client, temperature=0.5, sampling={"use_entropy_sampling": True, "repetition_penalty": 1.3},
                      stop_token_ids=[10, 10, 32]).status_code == 200
    a, b = stack.scheduler.submits
    a, b = a.options, b.options
    assert not a.sampling.use_entropy_sampling and a.sampling.temperature == pytest.approx(0.5)
    assert a.sampling.top_p == pytest.approx(0.9) and a.seed == 7
    assert a.block_diffusion.tokens_per_step == 4 and a.block_diffusion.confidence_threshold == pytest.approx(0.9)
    assert b.sampling.use_entropy_sampling and b.sampling.repetition_penalty == pytest.approx(1.3)
    assert list(b.stop_ids) == [10, 32]


@pytest.mark.e2e
def test_completion_sse_framing_done_and_usage(client: httpx.Client) -> None:
    r = completion(client, stream=True, stream_options={"include_usage": True}, attribution="tokens")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(r.text)
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == TEXT and "\ufffd" not in "".join(texts)
    blocks = [c for c in chunks if "block_index" in c.get("cde", {})]
    assert [c["choices"][0]["text"] for c in blocks] == ["Hello, caf", "é!"]
    assert blocks[0]["cde"]["token_attributions"][0]["top"][0]["concept_id"] == 0
    assert chunks[0]["cde"]["seed"] >= 0 and chunks[0]["cde"]["prompt_tokens"] == 2
    *body, usage = chunks
    assert body[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2 + N_OUT
    assert all(c["usage"] is None for c in body)


@pytest.mark.e2e
def test_chat_completion_applies_template_stream_and_not(client: httpx.Client, stack: Stack) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT}
    want = ByteTokenizer().apply_chat_template([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}])
    assert list(stack.scheduler.submits[0].prompt_tokens) == want
    assert stack.scheduler.submits[0].options.max_new_tokens == 8
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": True})
    frames = sse_frames(r.text)
    chunks = [json.loads(f) for f in frames[:-1]]
    assert frames[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


@pytest.mark.e2e
def test_unmodified_openai_client(gw: GatewayHandle, client: httpx.Client) -> None:
    import openai

    oa = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    assert [m.id for m in oa.models.list()] == [MODEL]
    c = oa.completions.create(model=MODEL, prompt="Hi", max_tokens=16, seed=3)
    assert c.choices[0].text == TEXT and c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == N_OUT
    text = "".join(ch.choices[0].text for ch in oa.completions.create(model=MODEL, prompt="Hi", stream=True) if ch.choices)
    assert text == TEXT
    chat = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0.2,
                                      extra_body={"attribution": "tokens"})
    assert chat.choices[0].message.content == TEXT and chat.usage.total_tokens > N_OUT
    parts, usage = [], None
    for ch in oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                         stream_options={"include_usage": True}):
        parts += [ch.choices[0].delta.content or ""] if ch.choices else []
        usage = ch.usage or usage
    assert "".join(parts) == TEXT and usage.completion_tokens == N_OUT
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="gpt-4", prompt="Hi")


@pytest.mark.e2e
def test_stop_strings_cut_the_text_and_cancel_upstream(client: httpx.Client) -> None:
    body = completion(client, stop=", c").json()
    assert body["choices"][0] == {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 5   # the tokens of "Hello", not the block's 11
    r = completion(client, stop=["é"], stream=True, stream_options={"include_usage": True})
    *chunks, usage = [json.loads(f) for f in sse_frames(r.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, caf"
    assert usage["usage"]["completion_tokens"] == 10   # the half of "é" in block 0 is not returned
    r = completion(client, stop="!", stream=True, stream_options={"include_usage": True})
    *chunks, usage = [json.loads(f) for f in sse_frames(r.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, café"
    assert usage["usage"]["completion_tokens"] == 12   # "é" is two byte tokens


@pytest.mark.e2e
def test_stream_mode_steps_emits_step_events(client: httpx.Client, stack: Stack) -> None:
    r = completion(client, stream=True, stream_mode="steps")
    chunks = [json.loads(f) for f in sse_frames(r.text)[:-1]]
    steps = [c for c in chunks if c["object"] == "cde.step"]
    assert stack.scheduler.submits[0].stream_steps and len(steps) == 2
    assert steps[0]["choices"] == [] and steps[0]["cde"]["tokens"] == [ord("H")]


@pytest.mark.e2e
def test_steering_is_resolved_through_steering_svc(client: httpx.Client, stack: Stack) -> None:
    steering = {"concepts": [{"name": "Ocean", "strength": 2.0}, {"id": 1}], "mode": "suppress",
                "schedule": "hard_cutoff", "cutoff": 16, "target": -5.0, "inject_layer": 1}
    assert completion(client, steering=steering).status_code == 200
    (build,) = stack.steering.builds
    s = build.steering
    assert build.model == MODEL and s.mode == common_pb2.STEERING_MODE_SUPPRESS and s.cutoff_tokens == 16
    assert s.concepts[0].name == "Ocean" and s.concepts[0].strength == 2.0 and s.concepts[1].concept_id == 1
    assert s.inject_layer == 1 and s.target == -5.0 and s.schedule == common_pb2.STEERING_SCHEDULE_HARD_CUTOFF
    sub = stack.scheduler.submits[0]
    assert list(sub.steering.concept_ids) == [0, 1] and sub.steering.model == MODEL
    # unset fields reach steering_svc as the mode's preset: the gateway is where defaults are chosen
    stack.steering.builds.clear()
    for mode, target, layer, schedule in (
            ("amplify", 8.0, 1, common_pb2.STEERING_SCHEDULE_HARD_CUTOFF),   # ceil(8 * 4 / 32) of 4 layers
            ("suppress", -7.0, 2, common_pb2.STEERING_SCHEDULE_FIXED)):
        assert completion(client, steering={"concepts": [{"id": 1}], "mode": mode}).status_code == 200
        s = stack.steering.builds[-1].steering
        assert (s.target, s.inject_layer, s.schedule, s.cutoff_tokens) == (target, layer, schedule, 32), mode
        assert s.concepts[0].strength == 1.0


# ---- REST: errors ----------------------------------------------------------------------------
BAD_REQUESTS = [
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("max_tokens 0", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over limit", "/v1/completions", {"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("context overflow", "/v1/completions", {"prompt": "x" * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("unknown concept", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"name": "oceanx"}]}}, 404,
     "steering.concepts"),
    ("unknown concept id", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 999}]}}, 404,
     "steering.concepts"),
    ("strength too big", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 1, "strength": 50}]}},
     400, "steering.concepts[0].strength"),
    ("strength negative", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 1, "strength": -1}]}},
     400, "steering.concepts[0].strength"),
    ("id and name", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 1, "name": "ocean"}]}}, 400, None),
    ("inject layer", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 1}], "inject_layer": 99}},
     400, "steering.inject_layer"),
    ("typo in extension", "/v1/completions", {"prompt": "Hi", "steering": {"concepts": [{"id": 1, "strenght": 2}]}},
     422, None),
    ("wrong type", "/v1/completions", {"prompt": "Hi", "max_tokens": "lots"}, 422, "max_tokens"),
    ("prompt not text", "/v1/completions", {"prompt": 123}, 422, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 422, "prompt"),
    ("unknown model", "/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("n above its limit", "/v1/completions", {"prompt": "Hi", "n": 17}, 400, "n"),
    ("ISD stride", "/v1/completions", {"prompt": "Hi", "decode": {"stride": 4}}, 400, "decode.stride"),
    ("tokens per step", "/v1/completions", {"prompt": "Hi", "decode": {"tokens_per_step": 65}}, 400, None),
    ("stop id", "/v1/completions", {"prompt": "Hi", "stop_token_ids": [9999]}, 400, "stop_token_ids"),
    ("temperature", "/v1/completions", {"prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ("penalty", "/v1/completions", {"prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("bad prompt id", "/v1/completions", {"prompt": [1, 2, MASK]}, 400, "prompt"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error(client: httpx.Client, path: str, body: dict, status: int, param: str | None) -> None:
    err = assert_openai_error(client.post(path, json={"model": MODEL, **body}), status)
    if param is not None:
        assert err["param"] == param, err
    if "oceanx" in json.dumps(body):
        assert "oceanx" in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.e2e
def test_malformed_and_oversized_bodies_leave_the_app_healthy(client: httpx.Client) -> None:
    err = assert_openai_error(client.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    assert_openai_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 422)
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    err = assert_openai_error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:
        for _ in range(20):
            yield b" " * (64 << 10)
    assert_openai_error(client.post("/v1/completions", content=chunked()), 413)
    assert_openai_error(client.get("/v1/nope"), 404)
    assert client.get("/health").status_code == 200
    assert completion(client).status_code == 200


@pytest.mark.e2e
def test_overload_is_429_with_retry_after(client: httpx.Client, stack: Stack) -> None:
    stack.scheduler.mode = "exhausted"
    for stream in (False, True):
        r = completion(client, stream=stream)
        err = assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "2" and err["type"] == "rate_limit_error" and "queue is full" in err["message"]
    stack.scheduler.mode = "not_found"
    assert_openai_error(completion(client), 404)


@pytest.mark.e2e
def test_engine_error_is_500_or_an_in_band_error_event(client: httpx.Client, stack: Stack) -> None:
    stack.scheduler.mode = "error"
    err = assert_openai_error(completion(client), 500)
    assert "engine exploded" in err["message"] and err["type"] == "server_error"
    frames = sse_frames(completion(client, stream=True).text)
    assert frames[-1] == "[DONE]" and "engine exploded" in json.loads(frames[-2])["error"]["message"]


@pytest.mark.e2e
def test_client_disconnect_cancels_the_scheduler_call(gw: GatewayHandle, client: httpx.Client, stack: Stack) -> None:
    # a request that finished sends no Detach
    assert completion(client).status_code == 200
    assert not stack.scheduler.detached.wait(0.3), stack.scheduler.detaches
    stack.scheduler.mode = "slow"
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
        for line in r.iter_lines():
            if '"block_index"' in line:
                break
    assert stack.scheduler.cancelled.wait(5), "scheduler call still running after the client left"
    # ... and says that its client left (the scheduler cancels at once, no detach grace)
    assert stack.scheduler.detached.wait(5), "no Detach after the client left"
    (d,) = stack.scheduler.detaches
    sub = stack.scheduler.submits[-1]
    assert d.request_id == sub.request_id and d.attach_id == stack.scheduler.attach_ids[-1] != "", \
        (d, sub.request_id, stack.scheduler.attach_ids)
    deadline = time.monotonic() + 5
    while "cde:gateway_requests_in_flight{model_name=\"steerling-tiny\"} 0.0" not in client.get("/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---- REST: catalog and operations -----------------------------------------------------------
@pytest.mark.e2e
def test_models_and_concept_search(client: httpx.Client) -> None:
    (m,) = client.get("/v1/models").json()["data"]
    assert m["id"] == MODEL and m["cde"]["diffusion_block_size"] == 64 and m["cde"]["max_context"] == 1024
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/other"), 404)
    data = client.get("/v1/concepts", params={"q": "oce", "limit": 5}).json()["data"]
    assert [c["name"] for c in data] == ["ocean"] and data[0]["group_id"] is None
    assert client.get("/v1/concepts", params={"q": "river"}).json()["data"][0]["group_name"] == "water"
    assert assert_openai_error(client.get("/v1/concepts", params={"q": " "}), 400)["param"] == "q"
    assert_openai_error(client.get("/v1/concepts", params={"q": "x", "limit": 0}), 400)
    # a query string only carries text: a limit that is not a number is a bad value (400), not a type error
    assert assert_openai_error(client.get("/v1/concepts", params={"q": "x", "limit": "many"}), 400)["param"] == "limit"


@pytest.mark.e2e
def test_health_follows_backends(client: httpx.Client, stack: Stack) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["stages"] == {"scheduler": "SERVING", "steering": "SERVING", "workers": "SERVING"}
    stack.run(stack.steer_health.set_serving(False))
    try:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["stages"]["steering"] == "NOT_SERVING"
        assert "steering" in r.json()["error"]["message"]
    finally:
        stack.run(stack.steer_health.set_serving(True))
    stack.scheduler.workers = 0
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["stages"]["workers"] == "no workers registered"
    stack.scheduler.workers = 1
    assert client.get("/health").status_code == 200


@pytest.mark.e2e
def test_scheduler_down_is_503(stack: Stack) -> None:
    # the gateway retries an unreachable scheduler for reattach_s before answering 503
    down = stack.gateway(scheduler="127.0.0.1:1", grpc_port=-1, reattach_s=1.0)
    with httpx.Client(base_url=down.base_url, timeout=10) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["stages"]["scheduler"].startswith("unreachable")
        err = assert_openai_error(completion(c), 503)
        assert err["type"] == "server_error" and err["code"] == "backend_unavailable"
        assert "cde:scheduler_up{model_name=\"steerling-tiny\"} 0.0" in c.get("/metrics").text


@pytest.mark.e2e
def test_metrics_and_openapi(client: httpx.Client) -> None:
    assert completion(client).status_code == 200
    text = client.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "time_to_first_block_seconds",
                 "inter_block_latency_seconds"):
        assert f"cde:{name}" in text, name
    assert 'cde:kv_cache_usage_perc{model_name="steerling-tiny"} 0.25' in text
    assert 'cde:num_requests_waiting{model_name="steerling-tiny"} 2.0' in text
    assert 'cde:time_to_first_block_seconds_count{model_name="steerling-tiny"}' in text
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions", "/v1/concepts"} <= set(spec["paths"])
    assert "SteeringIn" in spec["components"]["schemas"]


@pytest.mark.e2e
def test_api_keys_and_rate_limit(stack: Stack) -> None:
    keyed = stack.gateway(api_keys="k1,k2", rate_limit_rpm=2)
    with httpx.Client(base_url=keyed.base_url, timeout=10) as c:
        err = assert_openai_error(completion(c), 401)
        assert err["type"] == "authentication_error"
        assert_openai_error(c.post("/v1/completions", json={"prompt": "Hi"}, headers={"Authorization": "Bearer k3"}), 401)
        ok = {"Authorization": "Bearer k2"}
        assert c.post("/v1/completions", json={"prompt": "Hi"}, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        r = c.get("/v1/models", headers=ok)
        assert_openai_error(r, 429)
        assert int(r.headers["retry-after"]) >= 1
        assert c.get("/health").status_code == 200  # infrastructure endpoints stay open
        assert c.get("/metrics").status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(generate_pb2.ListModelsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.ListModels(generate_pb2.ListModelsRequest(), timeout=5,
                               metadata=(("authorization", "Bearer k1"),)).models[0].id == MODEL


# ---- public gRPC ------------------------------------------------------------------------------
@pytest.mark.e2e
def test_grpc_generate_streams_the_same_blocks_as_rest(gw: GatewayHandle, client: httpx.Client, stack: Stack) -> None:
    rest = completion(client, stream=True, attribution="all")
    rest_blocks = [json.loads(f)["cde"] for f in sse_frames(rest.text)[:-1] if '"block_index"' in f]
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        req = generate_pb2.GenerateRequest(model=MODEL, prompt="Hi", decode=common_pb2.DecodeOptions(max_new_tokens=16),
                                           attribution=common_pb2.ATTRIBUTION_ALL)
        events = list(stub.Generate(req, timeout=10))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds == ["accepted", "block", "block", "finished"]
        blocks = [e.block for e in events if e.WhichOneof("event") == "block"]
        assert [b.text for b in blocks] == ["Hello, caf", "é!"]
        assert [list(b.tokens) for b in blocks] == [b["tokens"] for b in rest_blocks]
        assert [b.block_index for b in blocks] == [b["block_index"] for b in rest_blocks]
        assert blocks[0].token_attributions[0].top[0].label == "Known: ocean"
        assert events[0].accepted.seed == stack.scheduler.submits[-1].options.seed
        assert events[-1].finished.reason == common_pb2.FINISH_REASON_STOP
        assert events[-1].finished.usage.completion_tokens == N_OUT

        for bad, code in ((generate_pb2.GenerateRequest(model="gpt-4", prompt="Hi"), grpc.StatusCode.NOT_FOUND),
                          (generate_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
                          (generate_pb2.GenerateRequest(prompt="Hi", steering=common_pb2.SteeringRequest(
                              concepts=[common_pb2.SteeringConcept(name="oceanx")])), grpc.StatusCode.NOT_FOUND),
                          (generate_pb2.GenerateRequest(prompt="Hi", decode=common_pb2.DecodeOptions(isd_stride=2)),
                           grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=5))
            assert e.value.code() == code, e.value.details()
        stack.scheduler.mode = "exhausted"
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "1500") in tuple(e.value.trailing_metadata())
        stack.scheduler.mode = "ok"

        resumed = list(stub.Resume(common_pb2.ResumeRequest(request_id="r1"), timeout=5))
        assert [e.block.text for e in resumed if e.WhichOneof("event") == "block"] == ["Hello, caf", "é!"]
        assert resumed[-1].finished.usage.completion_tokens == N_OUT
        resumed = list(stub.Resume(common_pb2.ResumeRequest(request_id="r1", after_block=0), timeout=5))
        assert [list(e.block.tokens) for e in resumed if e.WhichOneof("event") == "block"] == [list(b"\xa9!")]
        assert resumed[-1].finished.usage.completion_tokens == 2  # filled in from the blocks seen

        assert stub.ListModels(generate_pb2.ListModelsRequest(), timeout=5).models[0].n_known_concepts == 48
        found = stub.SearchConcepts(common_pb2.SearchConceptsRequest(query="riv"), timeout=5)
        assert [c.name for c in found.concepts] == ["river"]
        assert stub.Cancel(common_pb2.CancelRequest(request_id="abc"), timeout=5).cancelled

        from grpc_health.v1 import health_pb2, health_pb2_grpc
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 5
        while health.Check(health_pb2.HealthCheckRequest(service="cde.v1.Generation"), timeout=5).status != \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
