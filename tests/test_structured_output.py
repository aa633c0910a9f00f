"""Structured output (cde/grammar.py on llguidance) for block diffusion: response_format compiles or
is refused naming its field; under a grammar the engine commits left to right, one token a step,
from the model's distribution masked to the grammar, equal token for token to the reference
decoder under the same grammar (batched with unconstrained requests, which keep their own text);
and 100 seeded generations of a random model all match their schema or regex. Served: REST chat
and completions, streamed or not, and gRPC, through a real stack; bad formats get 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import random
import re

import grpc
import httpx
import jsonschema
import pytest
import torch

from cde.grammar import GrammarError, GrammarVocabulary, compile_response_format
from cde.rpc.v1 import generate_pb2, generate_pb2_grpc
from cde.steerling.config import TINY
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from cde.steerling.tokenizer import ByteTokenizer
from tests.options import decode_options
from tests.steerling_engine_cases import VOCAB, make_model, steer
from worker_svc.engine.events import FinishEvent, StepEvent
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import SteerlingEngine

TOKENIZER = ByteTokenizer()

# bounded outputs: a random model fills every string to its maxLength at worst
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 999}},
     "required": ["name", "ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 5},
]
REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"(yes|no|maybe)", r"[0-9]{3}-[0-9]{4}"]  # ([0-9]: llguidance knows newer Unicode \d digits than this Python)


@pytest.fixture(scope="module")
def vocab():
    return GrammarVocabulary.of_steerling(TOKENIZER, TINY.vocab_size, TINY.eot_id)


def _formats():
    return ([{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s}} for i, s in enumerate(SCHEMAS)]
            + [{"type": "regex", "regex": r} for r in REGEXES])


def _valid(fmt: dict, tokens: list[int]) -> bool:
    text = TOKENIZER.decode(tokens)
    if fmt["type"] == "regex":
        return re.fullmatch(fmt["regex"], text) is not None
    try:
        jsonschema.validate(json.loads(text), fmt["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("fmt,field", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1, 2]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "regex", "regex": "(("}, "response_format.regex"),
    ({"type": "regex"}, "response_format.regex"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "regex", "regex": "a" * 70_000}, "response_format.regex"),
])
def test_a_bad_response_format_is_refused_naming_its_field(fmt, field):
    with pytest.raises(GrammarError) as e:
        compile_response_format(fmt)
    assert e.value.field == field, str(e.value)


def test_text_and_json_object_compile(vocab):
    assert compile_response_format(None) is None and compile_response_format({"type": "text"}) is None
    c = vocab.constraint(compile_response_format({"type": "json_object"}))
    assert c.allowed().nonzero()[0].tolist() == [ord("{")]


@pytest.mark.parity
def test_a_grammar_request_equals_the_reference_decoder_under_the_same_grammar(vocab, seed):
    model = make_model(seed, TINY)
    rng = random.Random(seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64)
    fmts = _formats()
    cases = []
    for i in range(6):
        fmt = fmts[rng.randrange(len(fmts))] if i % 3 else None   # every third: unconstrained beside them
        prompt = [rng.randrange(256) for _ in range(rng.choice((3, 64, 70)))]
        sampling = SamplingParams() if i % 2 else SamplingParams(use_entropy_sampling=False, temperature=0.9)
        opts = decode_options(90, sampling=sampling, tokens_per_step=rng.choice((1, 4)), seed=rng.randrange(1 << 40))
        st = steer(model, [rng.randrange(TINY.n_known) for _ in range(2)]) if i == 4 else None
        grammar = None if fmt is None else compile_response_format(fmt)
        job = Job(f"g{i}", prompt, opts, steering=st,
                  constraint=None if grammar is None else vocab.constraint(grammar))
        cases.append((fmt, grammar, prompt, opts, st, engine.submit(job)))
    engine.run_until_idle()
    for i, (fmt, grammar, prompt, opts, st, handle) in enumerate(cases):
        tag = f"seed={seed} request {i} format {fmt}"
        events = list(engine.drain(handle))
        (fin,) = [e for e in events if isinstance(e, FinishEvent)]
        ref = generate(model, prompt, opts, st, tokenizer_vocab_size=VOCAB,
                       constraint=None if grammar is None else vocab.constraint(grammar))
        assert fin.output_tokens == ref.output_tokens, tag
        if grammar is None:
            continue
        steps = [e for e in events if isinstance(e, StepEvent)]
        assert all(len(e.positions) == 1 for e in steps), tag
        order = [e.positions[0] for e in steps]
        assert order == sorted(order), f"{tag}: not left to right"
        if fin.reason == "stop":
            assert _valid(fmt, fin.output_tokens), f"{tag}: {TOKENIZER.decode(fin.output_tokens)!r}"


@pytest.mark.slow
def test_a_hundred_seeded_generations_all_match_their_format(vocab, seed):
    torch.manual_seed(seed)
    model = make_model(seed, TINY, dtype=torch.float32)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=256, max_slots=64)
    rng = random.Random(seed)
    fmts = _formats()
    grammars = [compile_response_format(f) for f in fmts]
    runs = []
    for i in range(100):
        k = i % len(fmts)
        prompt = [rng.randrange(256) for _ in range(rng.randrange(2, 40))]
        opts = decode_options(100, sampling=SamplingParams(), tokens_per_step=4, seed=rng.randrange(1 << 40))
        runs.append((k, engine.submit(Job(f"h{i}", prompt, opts, stream_steps=False, records=False,
                                          constraint=vocab.constraint(grammars[k])))))
    engine.run_until_idle()
    for i, (k, handle) in enumerate(runs):
        (fin,) = [e for e in engine.drain(handle) if isinstance(e, FinishEvent)]
        text = TOKENIZER.decode(fin.output_tokens)
        assert fin.reason == "stop", f"seed={seed} request {i} ({fmts[k]}) ran out of tokens: {text!r}"
        assert _valid(fmts[k], fin.output_tokens), f"seed={seed} request {i} ({fmts[k]}): {text!r}"


# ---- served: gateway (REST and gRPC) -> scheduler -> worker, real processes on loopback ----------

def _chat(stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Describe a thing."}], "max_tokens": 100} | body)


@pytest.mark.e2e
def test_served_json_schema_outputs_match_their_schema_streamed_or_not(stack, seed):
    schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    for i in range(4):
        body = {"response_format": fmt, "seed": seed + i, "attribution": "tokens"}
        r = _chat(stack, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tag = f"seed={seed + i}: {choice['message']['content']!r}"
        assert choice["finish_reason"] == "stop", tag
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        streamed = ""
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Describe a thing."}], "max_tokens": 100,
                "stream": True} | body) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"]
                    streamed += "".join(c.get("delta", {}).get("content") or "" for c in delta)
        assert streamed == choice["message"]["content"], tag


@pytest.mark.e2e
def test_served_regex_over_completions_and_grpc(stack, seed):
    regex = REGEXES[0]
    r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
        "prompt": "mail: ", "max_tokens": 60, "seed": seed, "response_format": {"type": "regex", "regex": regex}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert re.fullmatch(regex, text), f"seed={seed}: {text!r}"

    async def over_grpc() -> str:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['gateway_grpc']}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            req = generate_pb2.GenerateRequest(prompt="mail: ", response_format=generate_pb2.ResponseFormat(regex=regex))
            req.decode.max_new_tokens = 60
            req.decode.seed = seed
            out = ""
            async for ev in stub.Generate(req, timeout=120):
                if ev.WhichOneof("event") == "block":
                    out += ev.block.text
            return out
    assert asyncio.run(over_grpc()) == text, f"seed={seed}: gRPC and REST differ"


@pytest.mark.e2e
@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "regex", "regex": "(("}, "response_format.regex"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_served_bad_formats_get_400_naming_the_field(stack, fmt, param):
    r = _chat(stack, {"response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert _chat(stack, {"max_tokens": 4}).status_code == 200   # and the server goes on
