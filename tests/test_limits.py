"""One rule per bound (cde/limits.py), checked through the real services.

Each bound is tried at its extremes (accepted) and one step past them (refused with a 400, or
INVALID_ARGUMENT, naming the field): over REST and the public gRPC API through the whole stack
(gateway, steering_svc, scheduler, worker as real processes), and on steering_svc's own gRPC
face, which applies the same checks to the requests the gateway resolved. The worker's face
runs every extreme and refuses only what it alone knows. Also: cde.limits imports without
torch, its check functions name the field, the README's Limits table is the generated one, and
/openapi.json carries the bounds.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from cde import limits as L
from cde.launch import ROOT, TINY_MODEL as DEFAULT_MODEL
from cde.rpc import channel_options, resolved
from cde.rpc.v1 import (common_pb2, generate_pb2, generate_pb2_grpc, resolved_pb2, steering_pb2, steering_pb2_grpc,
                        worker_pb2, worker_pb2_grpc)
from cde.steerling.config import SteerlingConfig
from tests.stack_fixture import internal_aio_channel, running_stack, service

CFG = SteerlingConfig.load(DEFAULT_MODEL)
N_LAYERS, BLOCK = CFG.n_layers, CFG.diff_block_size
MAX_TOKENS_LIMIT = 8      # the stack's --max-tokens-limit: its extreme is cheap to generate
TIMEOUT = 120


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


# proto float fields are float32: one past a bound there is the next float32 (a float64 step
# would round back onto the bound in transit)
def above32(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def below32(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


# ---- no stack ---------------------------------------------------------------------------------
def test_limits_imports_without_torch() -> None:
    """cde.limits (and the gateway's schemas built on it) import with torch made unimportable."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cde.limits, gateway.schemas\n"
        "assert 'torch' not in sys.modules\n"
        "print(cde.limits.inject_layer_bounds(32))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1, 32)"
    blocked = subprocess.run([sys.executable, "-c", code.replace("import cde.limits, gateway.schemas", "import torch")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert blocked.returncode != 0 and "blocked" in blocked.stderr   # the blocker itself works


def test_readme_limits_table_is_the_generated_one() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- limits table:")
    start = readme.index("\n", start) + 1
    end = readme.index("<!-- end of limits table -->")
    assert readme[start:end].strip() == L.markdown_table(), "README Limits table is stale: python -m cde.limits"


def test_model_dependent_bounds() -> None:
    assert L.inject_layer_bounds(32) == (1, 32) and L.inject_layer_bounds(1) == (1, 1)
    for n in (1, 2, 4, 8, 9, 32):
        for amplify in (True, False):
            lo, hi = L.inject_layer_bounds(n)
            assert lo <= L.default_inject_layer(n, amplify) <= hi, (n, amplify)
    assert L.default_inject_layer(32, True) == 8 and L.default_inject_layer(32, False) == 16
    assert L.tokens_per_step_bounds(64) == (1, 64)


CHECKS: list[tuple[str, Any, str]] = [
    ("max_tokens past the limit", lambda: L.check_length(1, 9, 100, 8), "max_tokens"),
    ("max_tokens past the context", lambda: L.check_length(95, 8, 100, 8), "max_tokens"),
    ("prompt fills the context", lambda: L.check_length(100, None, 100, 8), "prompt"),
    ("temperature", lambda: L.check_sampling(above(L.TEMPERATURE_MAX), 1.0, 1.0), "temperature"),
    ("top_p nan", lambda: L.check_sampling(1.0, math.nan, 1.0), "top_p"),
    ("repetition_penalty 0", lambda: L.check_sampling(1.0, 1.0, 0.0), "repetition_penalty"),
    ("tokens_per_step 0", lambda: L.check_tokens_per_step(0, BLOCK), "decode.tokens_per_step"),
    ("tokens_per_step", lambda: L.check_tokens_per_step(BLOCK + 1, BLOCK), "decode.tokens_per_step"),
    ("threshold 0", lambda: L.check_threshold(0.0), "decode.threshold"),
    ("threshold nan", lambda: L.check_threshold(math.nan), "decode.threshold"),
    ("stride", lambda: L.check_stride(L.MAX_STRIDE + 1), "decode.stride"),
    ("stop ids", lambda: L.check_stop_ids([5], 5), "stop_token_ids"),
    ("attribution_top_k", lambda: L.check_attribution_top_k(0), "attribution_top_k"),
    ("no concepts", lambda: L.check_concept_count(0), "steering.concepts"),
    ("no reference", lambda: L.check_concept(2, None, None), "steering.concepts[2]"),
    ("blank name", lambda: L.check_concept(0, " ", None), "steering.concepts[0]"),
    ("name too long", lambda: L.check_concept(0, "o" * (L.CONCEPT_NAME_MAX + 1), None), "steering.concepts[0].name"),
    ("strength 0", lambda: L.check_strength(1, 0.0), "steering.concepts[1].strength"),
    ("target", lambda: L.check_steering_settings(math.inf, None, None, N_LAYERS), "steering.target"),
    ("inject_layer", lambda: L.check_steering_settings(None, N_LAYERS + 1, None, N_LAYERS), "steering.inject_layer"),
    ("cutoff", lambda: L.check_steering_settings(None, None, 0, N_LAYERS), "steering.cutoff"),
    ("cutoff with fixed", lambda: L.check_cutoff_applies(True, "fixed"), "steering.cutoff"),
    ("search query", lambda: L.check_search(" ", 1), "q"),
    ("search limit", lambda: L.check_search("o", L.SEARCH_LIMIT_MAX + 1), "limit"),
    ("list limit", lambda: L.check_list_limit(L.LIST_LIMIT_MAX + 1), "limit"),
    ("top_tokens", lambda: L.check_top_tokens(L.TOP_TOKENS_MAX + 1), "top_tokens"),
]


@pytest.mark.parametrize("what, check, path", CHECKS, ids=[c[0] for c in CHECKS])
def test_checks_name_the_field(what: str, check: Any, path: str) -> None:
    with pytest.raises(L.LimitError) as err:
        check()
    assert err.value.path == path and str(err.value) == err.value.message, what


def test_checks_pass_the_extremes() -> None:
    L.check_length(92, 8, 100, 8)
    L.check_length(99, None, 100, 8)
    L.check_sampling(L.TEMPERATURE_MAX, L.TOP_P_MIN, L.REPETITION_PENALTY_MAX)
    L.check_tokens_per_step(BLOCK, BLOCK)
    L.check_threshold(L.THRESHOLD_MAX)
    L.check_stride(L.MAX_STRIDE)
    L.check_stop_ids(list(range(L.MAX_STOP_IDS)), L.MAX_STOP_IDS)
    L.check_concept_count(L.MAX_CONCEPTS)
    L.check_concept(0, "o" * L.CONCEPT_NAME_MAX, L.STRENGTH_MAX)
    L.check_concept(0, 0, None)
    L.check_steering_settings(-L.TARGET_ABS_MAX, N_LAYERS, L.CUTOFF_MAX, N_LAYERS)
    L.check_cutoff_applies(True, "default")
    L.check_search("o" * L.SEARCH_QUERY_MAX_CHARS, L.SEARCH_LIMIT_MAX)
    with pytest.raises(L.LimitError, match="context") as err:
        L.check_length(93, 8, 100, 8)
    assert err.value.code == "context_length_exceeded"


def test_gateway_fills_every_steering_default() -> None:
    """What steering_svc receives: each unset field as its mode's preset, set fields untouched."""
    from gateway.resolve import resolved_steering

    for mode, amplify in ((common_pb2.STEERING_MODE_AMPLIFY, True), (common_pb2.STEERING_MODE_SUPPRESS, False)):
        preset = L.steering_preset(N_LAYERS, amplify)
        got = resolved_steering(common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="ocean")],
                                                           mode=mode), N_LAYERS)
        assert got.concepts[0].strength == L.DEFAULT_STRENGTH and got.target == preset.target
        assert got.inject_layer == L.default_inject_layer(N_LAYERS, amplify) and got.cutoff_tokens == L.DEFAULT_CUTOFF
        assert got.schedule == (common_pb2.STEERING_SCHEDULE_HARD_CUTOFF if amplify else common_pb2.STEERING_SCHEDULE_FIXED)
    given = common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(concept_id=3, strength=2.0)], target=-1.0,
                                       inject_layer=N_LAYERS, schedule=common_pb2.STEERING_SCHEDULE_FIXED,
                                       cutoff_tokens=5)
    assert resolved_steering(given, N_LAYERS) == given


def test_sampling_defaults_match_the_model_sampler() -> None:
    import dataclasses

    from cde.steerling.sampling import SamplingParams

    assert dataclasses.asdict(L.STEERLING_SAMPLING) == {
        k: getattr(SamplingParams(), k) for k in dataclasses.asdict(L.STEERLING_SAMPLING)}


def test_causal_worker_options_check_only_what_the_worker_knows() -> None:
    """The causal worker's option parsing (no stack: the causal stack is tests/test_causal_serving.py):
    its --max-stride and the fields of its family; the sampling bounds are the gateway's."""
    from worker_svc.request_options import isd_options
    from worker_svc.validation import BadRequest

    def submit(stride: int, **sampling: float) -> worker_pb2.WorkerSubmit:
        """A causal request as the gateway resolves it: the causal defaults, `sampling` overriding."""
        s = resolved.sampling(L.CAUSAL_SAMPLING)
        for name, value in sampling.items():
            setattr(s, name, value)
        return worker_pb2.WorkerSubmit(options=resolved.isd(seed=1, max_new_tokens=4, stride=stride,
                                                            sampling_options=s))

    def opts(**sampling: float):
        return isd_options(submit(L.MAX_STRIDE, **sampling), L.MAX_STRIDE, token_limit=1000)

    assert opts(temperature=L.TEMPERATURE_MAX, top_p=L.TOP_P_MAX).temperature == L.TEMPERATURE_MAX
    greedy = opts(temperature=1.0, top_p=L.TOP_P_MIN)   # the gateway lets top_p 0 through: greedy
    assert greedy.greedy and greedy.top_p == 1.0
    defaults = opts()
    assert (defaults.temperature, defaults.top_p) == (L.CAUSAL_SAMPLING.temperature, L.CAUSAL_SAMPLING.top_p)
    for bad, field in (({"use_entropy_sampling": True}, "use_entropy_sampling"),
                       ({"repetition_penalty": 1.1}, "repetition_penalty"), ({"top_k": 1001}, "top_k")):
        with pytest.raises(BadRequest, match=field):
            opts(**bad)
    with pytest.raises(BadRequest, match="isd.stride"):
        isd_options(submit(L.MAX_STRIDE + 1), L.MAX_STRIDE, token_limit=1000)
    with pytest.raises(BadRequest, match="isd.stride"):
        isd_options(submit(2), 1, token_limit=1000)   # a worker started with --max-stride 1


# ---- the stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("limits"),
                       gateway_args=["--max-tokens-limit", str(MAX_TOKENS_LIMIT)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=TIMEOUT) as c:
        yield c


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "steerling-tiny", "prompt": "Hi", "max_tokens": 1, "seed": 1, **fields}


def steer(**fields: Any) -> dict[str, Any]:
    return {"concepts": [{"name": "ocean"}], **fields}


ACCEPTED = None
# (what, body, param) - param None: accepted (a completion comes back); else 400 naming it.
REST_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("max_tokens min", body(max_tokens=1), ACCEPTED),
    ("max_tokens max", body(max_tokens=MAX_TOKENS_LIMIT), ACCEPTED),
    ("max_tokens 0", body(max_tokens=0), "max_tokens"),
    ("max_tokens past the limit", body(max_tokens=MAX_TOKENS_LIMIT + 1), "max_tokens"),
    ("temperature min", body(temperature=L.TEMPERATURE_MIN), ACCEPTED),
    ("temperature max", body(temperature=L.TEMPERATURE_MAX), ACCEPTED),
    ("temperature below", body(temperature=below(L.TEMPERATURE_MIN)), "temperature"),
    ("temperature above", body(temperature=above(L.TEMPERATURE_MAX)), "temperature"),
    ("top_p min", body(top_p=L.TOP_P_MIN, temperature=1.0), ACCEPTED),
    ("top_p max", body(top_p=L.TOP_P_MAX, temperature=1.0), ACCEPTED),
    ("top_p below", body(top_p=below(L.TOP_P_MIN)), "top_p"),
    ("top_p above", body(top_p=above(L.TOP_P_MAX)), "top_p"),
    ("repetition_penalty max", body(repetition_penalty=L.REPETITION_PENALTY_MAX), ACCEPTED),
    ("repetition_penalty 0", body(repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty above", body(repetition_penalty=above(L.REPETITION_PENALTY_MAX)), "repetition_penalty"),
    ("sampling.repetition_penalty above", body(sampling={"repetition_penalty": above(L.REPETITION_PENALTY_MAX)}),
     "sampling.repetition_penalty"),
    ("seed min", body(seed=0), ACCEPTED),
    ("seed max", body(seed=L.SEED_MAX), ACCEPTED),
    ("seed below", body(seed=-1), "seed"),
    ("seed above", body(seed=L.SEED_MAX + 1), "seed"),
    ("n max", body(n=L.N_MAX), ACCEPTED),
    ("n above", body(n=L.N_MAX + 1), "n"),
    ("best_of above", body(best_of=L.BEST_OF_MAX + 1), "best_of"),
    ("logprobs max", body(logprobs=L.TOP_LOGPROBS_MAX), ACCEPTED),
    ("logprobs above", body(logprobs=L.TOP_LOGPROBS_MAX + 1), "logprobs"),
    ("presence_penalty 0", body(presence_penalty=0.0), ACCEPTED),
    ("presence_penalty", body(presence_penalty=0.5), "presence_penalty"),
    ("frequency_penalty", body(frequency_penalty=0.5), "frequency_penalty"),
    ("stop max", body(stop=["\x01" * L.MAX_STOP_STRING_CHARS] * L.MAX_STOP_STRINGS), ACCEPTED),
    ("stop too many", body(stop=["\x01"] * (L.MAX_STOP_STRINGS + 1)), "stop"),
    ("stop too long", body(stop=["\x01" * (L.MAX_STOP_STRING_CHARS + 1)]), "stop[0]"),
    ("stop_token_ids max", body(stop_token_ids=list(range(100, 100 + L.MAX_STOP_IDS))), ACCEPTED),
    ("stop_token_ids too many", body(stop_token_ids=list(range(100, 101 + L.MAX_STOP_IDS))), "stop_token_ids"),
    ("tokens_per_step min", body(decode={"tokens_per_step": 1}), ACCEPTED),
    ("tokens_per_step max", body(decode={"tokens_per_step": BLOCK}, max_tokens=MAX_TOKENS_LIMIT), ACCEPTED),
    ("tokens_per_step 0", body(decode={"tokens_per_step": 0}), "decode.tokens_per_step"),
    ("tokens_per_step above", body(decode={"tokens_per_step": BLOCK + 1}), "decode.tokens_per_step"),
    ("threshold max", body(decode={"threshold": L.THRESHOLD_MAX}), ACCEPTED),
    ("threshold 0", body(decode={"threshold": 0.0}), "decode.threshold"),
    ("threshold above", body(decode={"threshold": above(L.THRESHOLD_MAX)}), "decode.threshold"),
    ("stride on a diffusion model", body(decode={"stride": 2}), "decode.stride"),
    ("stride above", body(decode={"stride": L.MAX_STRIDE + 1}), "decode.stride"),
    ("attribution_top_k min", body(attribution="tokens", attribution_top_k=1), ACCEPTED),
    ("attribution_top_k max", body(attribution="tokens", attribution_top_k=L.ATTRIBUTION_TOP_K_MAX), ACCEPTED),
    ("attribution_top_k 0", body(attribution="tokens", attribution_top_k=0), "attribution_top_k"),
    ("attribution_top_k above", body(attribution_top_k=L.ATTRIBUTION_TOP_K_MAX + 1), "attribution_top_k"),
    ("concepts max", body(steering={"concepts": [{"id": i} for i in range(L.MAX_CONCEPTS)]}), ACCEPTED),
    ("concepts too many", body(steering={"concepts": [{"id": i} for i in range(L.MAX_CONCEPTS + 1)]}),
     "steering.concepts"),
    ("concepts none", body(steering={"concepts": []}), "steering.concepts"),
    ("concept name too long", body(steering={"concepts": [{"name": "o" * (L.CONCEPT_NAME_MAX + 1)}]}),
     "steering.concepts[0].name"),
    ("strength max", body(steering={"concepts": [{"name": "ocean", "strength": L.STRENGTH_MAX}]}), ACCEPTED),
    ("strength 0", body(steering={"concepts": [{"name": "ocean", "strength": 0.0}]}), "steering.concepts[0].strength"),
    ("strength above", body(steering={"concepts": [{"name": "ocean", "strength": above(L.STRENGTH_MAX)}]}),
     "steering.concepts[0].strength"),
    ("target min", body(steering=steer(target=-L.TARGET_ABS_MAX)), ACCEPTED),
    ("target max", body(steering=steer(target=L.TARGET_ABS_MAX)), ACCEPTED),
    ("target suppress max", body(steering=steer(target=L.TARGET_ABS_MAX, mode="suppress")), ACCEPTED),
    ("target below", body(steering=steer(target=below(-L.TARGET_ABS_MAX))), "steering.target"),
    ("target above", body(steering=steer(target=above(L.TARGET_ABS_MAX))), "steering.target"),
    ("inject_layer min", body(steering=steer(inject_layer=1)), ACCEPTED),
    ("inject_layer max", body(steering=steer(inject_layer=N_LAYERS)), ACCEPTED),
    ("inject_layer max, suppress", body(steering=steer(inject_layer=N_LAYERS, mode="suppress")), ACCEPTED),
    ("inject_layer 0", body(steering=steer(inject_layer=0)), "steering.inject_layer"),
    ("inject_layer above", body(steering=steer(inject_layer=N_LAYERS + 1)), "steering.inject_layer"),
    ("cutoff min", body(steering=steer(schedule="hard_cutoff", cutoff=L.CUTOFF_MIN)), ACCEPTED),
    ("cutoff max", body(steering=steer(schedule="hard_cutoff", cutoff=L.CUTOFF_MAX)), ACCEPTED),
    ("cutoff 0", body(steering=steer(schedule="hard_cutoff", cutoff=L.CUTOFF_MIN - 1)), "steering.cutoff"),
    ("cutoff above", body(steering=steer(schedule="hard_cutoff", cutoff=L.CUTOFF_MAX + 1)), "steering.cutoff"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("what, payload, param", REST_CASES, ids=[c[0] for c in REST_CASES])
def test_rest_bounds_through_the_stack(client: httpx.Client, what: str, payload: dict, param: str | None) -> None:
    r = client.post("/v1/completions", json=payload)
    if param is ACCEPTED:
        assert r.status_code == 200, (what, r.text)
        out = r.json()
        assert out["object"] == "text_completion", (what, out)
        assert out["choices"][0]["finish_reason"] in ("stop", "length"), (what, out)
    else:
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (what, err)


@pytest.mark.e2e
def test_concept_name_at_its_bound_passes_to_the_catalog(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json=body(steering={"concepts": [{"name": "o" * L.CONCEPT_NAME_MAX}]}))
    assert r.status_code == 404 and r.json()["error"]["code"] == "concept_not_found", r.text


@pytest.mark.e2e
def test_body_size_bound(client: httpx.Client) -> None:
    def sized(n: int) -> bytes:
        payload = body(user="")
        pad = n - len(json.dumps(payload).encode())
        data = json.dumps({**payload, "user": "x" * pad}).encode()
        assert len(data) == n
        return data

    ok = client.post("/v1/completions", content=sized(L.MAX_BODY_BYTES), headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text[:300]
    big = client.post("/v1/completions", content=sized(L.MAX_BODY_BYTES + 1),
                      headers={"Content-Type": "application/json"})
    assert big.status_code == 413, big.text[:300]


CATALOG_CASES = [
    ("/v1/concepts", {"q": "o", "limit": L.SEARCH_LIMIT_MAX}, None),
    ("/v1/concepts", {"q": "o", "limit": L.SEARCH_LIMIT_MAX + 1}, "limit"),
    ("/v1/concepts", {"q": "o" * L.SEARCH_QUERY_MAX_CHARS}, None),
    ("/v1/concepts", {"q": "o" * (L.SEARCH_QUERY_MAX_CHARS + 1)}, "q"),
    ("/v1/concepts", {"limit": 1}, None),
    ("/v1/concepts", {"limit": L.LIST_LIMIT_MAX}, None),
    ("/v1/concepts", {"limit": 0}, "limit"),
    ("/v1/concepts", {"limit": L.LIST_LIMIT_MAX + 1}, "limit"),
    ("/v1/concepts/0", {"top_tokens": 0}, None),
    ("/v1/concepts/0", {"top_tokens": L.TOP_TOKENS_MAX}, None),
    ("/v1/concepts/0", {"top_tokens": L.TOP_TOKENS_MAX + 1}, "top_tokens"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("path, params, param", CATALOG_CASES)
def test_catalog_bounds_through_the_stack(client: httpx.Client, path: str, params: dict, param: str | None) -> None:
    r = client.get(path, params=params)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.e2e
def test_openapi_states_the_bounds(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def prop(model: str, name: str) -> dict[str, Any]:
        p = schemas[model]["properties"][name]
        if "anyOf" in p:   # optional fields: the non-null branch carries the bounds
            branch = next(b for b in p["anyOf"] if b.get("type") != "null")
            p = {**branch, **{k: v for k, v in p.items() if k != "anyOf"}}
        return p

    expected = [
        ("CompletionRequest", "temperature", {"minimum": L.TEMPERATURE_MIN, "maximum": L.TEMPERATURE_MAX}),
        ("CompletionRequest", "top_p", {"minimum": L.TOP_P_MIN, "maximum": L.TOP_P_MAX}),
        ("CompletionRequest", "repetition_penalty", {"exclusiveMinimum": 0.0, "maximum": L.REPETITION_PENALTY_MAX}),
        ("CompletionRequest", "seed", {"minimum": 0, "maximum": L.SEED_MAX}),
        ("CompletionRequest", "n", {"minimum": 1, "maximum": L.N_MAX}),
        ("CompletionRequest", "attribution_top_k", {"minimum": 1, "maximum": L.ATTRIBUTION_TOP_K_MAX,
                                                    "default": L.DEFAULT_ATTRIBUTION_TOP_K}),
        ("CompletionRequest", "stop_token_ids", {"maxItems": L.MAX_STOP_IDS}),
        ("ChatCompletionRequest", "attribution_top_k", {"maximum": L.ATTRIBUTION_TOP_K_MAX}),
        ("SteeringIn", "concepts", {"minItems": 1, "maxItems": L.MAX_CONCEPTS}),
        ("SteeringIn", "target", {"minimum": -L.TARGET_ABS_MAX, "maximum": L.TARGET_ABS_MAX}),
        ("SteeringIn", "inject_layer", {"minimum": 1}),
        ("SteeringIn", "cutoff", {"minimum": L.CUTOFF_MIN, "maximum": L.CUTOFF_MAX}),
        ("SteeringConceptIn", "strength", {"exclusiveMinimum": 0.0, "maximum": L.STRENGTH_MAX}),
        ("SteeringConceptIn", "name", {"maxLength": L.CONCEPT_NAME_MAX}),
        ("DecodeIn", "tokens_per_step", {"minimum": 1}),
        ("DecodeIn", "threshold", {"exclusiveMinimum": 0.0, "maximum": L.THRESHOLD_MAX}),
        ("DecodeIn", "stride", {"maximum": L.MAX_STRIDE}),
        ("CompletionRequest", "logprobs", {"minimum": 0, "maximum": L.TOP_LOGPROBS_MAX}),
        ("ChatCompletionRequest", "top_logprobs", {"minimum": 0, "maximum": L.TOP_LOGPROBS_MAX}),
        ("CompletionRequest", "echo_context_tokens", {"minimum": 1}),
    ]
    for model, name, bounds in expected:
        p = prop(model, name)
        for key, value in bounds.items():   # JSON numbers: 2^64 - 1 comes back as a float
            assert key in p and float(p[key]) == float(value), (model, name, key, p)
        assert p.get("description"), (model, name, "no description")
    # the bounds a schema cannot hold (the model's, the server's) are stated in the descriptions
    assert "n_layers" in prop("SteeringIn", "inject_layer")["description"]
    assert "block size" in prop("DecodeIn", "tokens_per_step")["description"]
    assert "max-tokens-limit" in prop("CompletionRequest", "max_tokens")["description"]
    stop = schemas["CompletionRequest"]["properties"]["stop"]
    assert f"at most {L.MAX_STOP_STRINGS} strings" in stop["description"]
    for model, name in (("CompletionRequest", "presence_penalty"), ("CompletionRequest", "frequency_penalty")):
        assert "not supported" in schemas[model]["properties"][name]["description"], (model, name)
    params = {p["name"]: p for p in spec["paths"]["/v1/concepts"]["get"]["parameters"]}
    limit = params["limit"]["schema"]
    limit = next(b for b in limit.get("anyOf", [limit]) if b.get("type") != "null")
    assert limit["maximum"] == L.LIST_LIMIT_MAX and str(L.SEARCH_LIMIT_MAX) in params["limit"]["description"]
    top = {p["name"]: p for p in spec["paths"]["/v1/concepts/{concept_id}"]["get"]["parameters"]}["top_tokens"]
    assert top["schema"]["maximum"] == L.TOP_TOKENS_MAX and top["schema"]["default"] == L.DEFAULT_TOP_TOKENS


# ---- gRPC faces -----------------------------------------------------------------------------------
def run(coro) -> Any:
    return asyncio.run(coro)


def steering_request(**fields: Any) -> common_pb2.SteeringRequest:
    return common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="ocean")], **fields)


STEERING_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("inject_layer min", dict(inject_layer=1), None),
    ("inject_layer max", dict(inject_layer=N_LAYERS), None),
    ("inject_layer 0", dict(inject_layer=0), "inject_layer"),
    ("inject_layer above", dict(inject_layer=N_LAYERS + 1), "inject_layer"),
    ("target min", dict(target=-L.TARGET_ABS_MAX), None),
    ("target max", dict(target=L.TARGET_ABS_MAX), None),
    ("target below", dict(target=below32(-L.TARGET_ABS_MAX)), "target"),
    ("target above", dict(target=above32(L.TARGET_ABS_MAX)), "target"),
    ("cutoff min", dict(cutoff_tokens=L.CUTOFF_MIN, schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF), None),
    ("cutoff max", dict(cutoff_tokens=L.CUTOFF_MAX, schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF), None),
    ("cutoff 0", dict(cutoff_tokens=0, schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF), "cutoff"),
    ("cutoff above", dict(cutoff_tokens=L.CUTOFF_MAX + 1, schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF),
     "cutoff"),
]


@pytest.mark.e2e
@pytest.mark.contract
def test_public_grpc_and_steering_svc_apply_the_same_bounds(stack) -> None:
    """Each case through the public gRPC API (gateway -> steering_svc -> worker) and straight
    against steering_svc (as the gateway resolves it): both accept the extremes and refuse one
    past them, naming the field. steering_svc refuses a request whose defaults were not filled in."""
    from gateway.resolve import resolved_steering

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['gateway_grpc']}",
                                             options=channel_options()) as gch, \
                internal_aio_channel(stack, stack.ports['steering'], options=channel_options()) as sch:
            gen, steering = generate_pb2_grpc.GenerationStub(gch), steering_pb2_grpc.SteeringStub(sch)
            extra_strength = [("strength max", L.STRENGTH_MAX, None),
                              ("strength above", above32(L.STRENGTH_MAX), "strength")]
            cases = [(w, steering_request(**f), p) for w, f, p in STEERING_CASES]
            cases += [(w, common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="ocean", strength=x)]),
                       p) for w, x, p in extra_strength]
            many = [common_pb2.SteeringConcept(concept_id=i) for i in range(L.MAX_CONCEPTS + 1)]
            cases += [("concepts max", common_pb2.SteeringRequest(concepts=many[:-1]), None),
                      ("concepts too many", common_pb2.SteeringRequest(concepts=many), "concepts")]
            for what, st, param in cases:
                req = generate_pb2.GenerateRequest(model="steerling-tiny", prompt="Hi", steering=st,
                                                   decode=common_pb2.DecodeOptions(max_new_tokens=1, seed=1))
                build = steering_pb2.BuildSteeringRequest(steering=resolved_steering(st, N_LAYERS))
                if param is None:
                    events = [e async for e in gen.Generate(req, timeout=TIMEOUT)]
                    assert events[-1].WhichOneof("event") == "finished", what
                    assert events[-1].finished.reason != common_pb2.FINISH_REASON_ERROR, (what, events[-1])
                    await steering.BuildSteering(build, timeout=TIMEOUT)
                    continue
                for call in (lambda: gen.Generate(req, timeout=TIMEOUT).read(),
                             lambda: steering.BuildSteering(build, timeout=TIMEOUT)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
                    assert param in err.value.details(), (what, err.value.details())
            resolved_ok = resolved_steering(steering_request(), N_LAYERS)
            for field, unresolved in (("target", "target"), ("inject_layer", "inject_layer"),
                                      ("cutoff_tokens", "cutoff"), ("schedule", "schedule")):
                st = common_pb2.SteeringRequest()
                st.CopyFrom(resolved_ok)
                st.ClearField(field)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await steering.BuildSteering(steering_pb2.BuildSteeringRequest(steering=st), timeout=TIMEOUT)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
                assert f"steering.{unresolved}" in err.value.details(), (field, err.value.details())
    run(main())


def worker_submit(**overrides: Any) -> worker_pb2.WorkerSubmit:
    """A WorkerSubmit as the scheduler sends it; ``overrides`` set fields by dotted path
    ("options.sampling.temperature")."""
    options = resolved.block_diffusion(seed=1, max_new_tokens=1, tokens_per_step=1,
                                       sampling_options=resolved_pb2.ResolvedSampling(
                                           use_entropy_sampling=False, temperature=1.0, top_p=0.8,
                                           repetition_penalty=1.1))
    req = worker_pb2.WorkerSubmit(request_id=uuid.uuid4().hex, prompt_tokens=list(b"Hi"), options=options)
    for path, value in overrides.items():
        *parents, field = path.split(".")
        msg = req
        for name in parents:
            msg = getattr(msg, name)
        setattr(msg, field, value)
    return req


WORKER_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("temperature min", {"options.sampling.temperature": L.TEMPERATURE_MIN}, None),
    ("temperature max", {"options.sampling.temperature": L.TEMPERATURE_MAX}, None),
    ("top_p min", {"options.sampling.top_p": L.TOP_P_MIN}, None),
    ("top_p max", {"options.sampling.top_p": L.TOP_P_MAX}, None),
    ("repetition_penalty max", {"options.sampling.repetition_penalty": L.REPETITION_PENALTY_MAX}, None),
    ("tokens_per_step max", {"options.block_diffusion.tokens_per_step": BLOCK}, None),
    ("tokens_per_step above", {"options.block_diffusion.tokens_per_step": BLOCK + 1}, "tokens_per_step"),
    ("threshold max", {"options.block_diffusion.confidence_threshold": L.THRESHOLD_MAX}, None),
    ("threshold 0", {"options.block_diffusion.confidence_threshold": 0.0}, "confidence_threshold"),
    ("threshold above", {"options.block_diffusion.confidence_threshold": above32(L.THRESHOLD_MAX)}, "confidence_threshold"),
    ("seed max", {"options.seed": L.SEED_MAX}, None),
]


@pytest.mark.e2e
@pytest.mark.contract
def test_worker_runs_the_extremes_and_refuses_what_only_it_knows(stack) -> None:
    """The worker's own gRPC face, called directly (as the scheduler does): every extreme the
    gateway lets through runs; it refuses what only it knows (its model's block size and layers,
    its vocabulary, options missing or for the other family). The threshold bounds are the
    engine's own (DecodeOptions)."""
    from gateway.resolve import resolved_steering

    async def main() -> None:
        port = service(stack, "worker0").grpc_port
        async with internal_aio_channel(stack, port, options=channel_options()) as wch, \
                internal_aio_channel(stack, stack.ports['steering'], options=channel_options()) as sch:
            worker = worker_pb2_grpc.WorkerStub(wch)
            prepared = await steering_pb2_grpc.SteeringStub(sch).BuildSteering(steering_pb2.BuildSteeringRequest(
                steering=resolved_steering(steering_request(), N_LAYERS)), timeout=TIMEOUT)
            cases: list[tuple[str, worker_pb2.WorkerSubmit, str | None]] = [
                (w, worker_submit(**o), p) for w, o, p in WORKER_CASES]
            stops_ok = worker_submit()
            stops_ok.options.stop_ids.extend(range(100, 100 + L.MAX_STOP_IDS))
            stop_outside = worker_submit()
            stop_outside.options.stop_ids.append(CFG.vocab_size + 10)
            cases += [("stop ids max", stops_ok, None), ("stop id outside the vocabulary", stop_outside, "stop_ids")]
            # nothing is defaulted after the gateway: an unresolved request names what is missing
            no_options, no_sampling, isd_here = worker_submit(), worker_submit(), worker_submit()
            no_options.ClearField("options")
            no_sampling.options.ClearField("sampling")
            isd_here.options.isd.stride = 2
            cases += [("no options", no_options, "options"), ("no sampling", no_sampling, "options.sampling"),
                      ("isd on a block-diffusion worker", isd_here, "options.block_diffusion"),
                      ("tokens_per_step 0", worker_submit(**{"options.block_diffusion.tokens_per_step": 0}),
                       "tokens_per_step")]
            for what, field, value, param in (
                    ("inject_layer min", "inject_layer", 1, None), ("inject_layer max", "inject_layer", N_LAYERS, None),
                    ("inject_layer 0", "inject_layer", 0, "inject_layer"),
                    ("inject_layer above", "inject_layer", N_LAYERS + 1, "inject_layer"),
                    ("cutoff max", "cutoff_tokens", L.CUTOFF_MAX, None),
                    ("schedule default", "schedule", common_pb2.STEERING_SCHEDULE_DEFAULT, "schedule")):
                req = worker_submit()
                req.steering.CopyFrom(prepared)
                setattr(req.steering, field, value)
                cases.append((what, req, param))
            for what, req, param in cases:
                if param is None:
                    events = [e async for e in worker.Submit(req, timeout=TIMEOUT)]
                    assert events and events[-1].WhichOneof("event") == "finished", what
                    assert events[-1].finished.reason != common_pb2.FINISH_REASON_ERROR, (what, events[-1])
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await worker.Submit(req, timeout=TIMEOUT).read()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
                assert param in err.value.details(), (what, err.value.details())
    run(main())
