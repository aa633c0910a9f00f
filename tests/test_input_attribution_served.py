"""Input attribution served: POST /v1/attributions/inputs through a real stack (gateway ->
scheduler -> attribution_svc, which replays the stored request and computes integrated
gradients), against cde/steerling/input_attribution.py on the bundled model (itself equal to the
public package's faithful replay: tests/test_input_attribution.py). Streaming progress, chunks,
and the errors users hit (unknown request, a position nothing committed, bad n_steps)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
import torch

from cde.steerling.input_attribution import attribute, commit_groups
from cde.steerling.loading import load_model
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options

pytestmark = pytest.mark.e2e
MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "steerling-tiny"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR, dtype=torch.float32).eval()


def _post(stack, path, body, timeout=120):
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=timeout)


def _generate(stack, seed: int, tokens_per_step: int, max_tokens: int = 70, at_least: int = 1):
    """A stored request with at least `at_least` generated tokens: the random tiny model can sample
    EOS early (seed 339600245 stopped after 2 of 20), so later seeds (seed + 7919 k) are tried in
    turn. Returns (request id, prompt ids, the seed that made it)."""
    prompt = "Once upon a time"
    ids = _post(stack, "/tokenize", {"prompt": prompt}).json()["tokens"]
    for k in range(16):
        s = seed + 7919 * k
        r = _post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "seed": s,
                                             "decode": {"tokens_per_step": tokens_per_step}})
        assert r.status_code == 200, r.text
        if r.json()["usage"]["completion_tokens"] >= at_least:
            return r.json()["id"], ids, s
    raise AssertionError(f"seed={seed}: 16 seeds in a row generated fewer than {at_least} tokens")


def _oracle(model, prompt, seed, tokens_per_step, max_tokens, n_steps):
    opts = decode_options(max_tokens, sampling=SamplingParams(), tokens_per_step=tokens_per_step, seed=seed)
    res = generate(model, prompt, opts, tokenizer_vocab_size=264)
    groups = commit_groups(res.steps)
    return attribute(model, prompt, len(prompt) + max_tokens, groups, n_steps), groups


def test_served_input_attribution_equals_the_replay(stack, model, seed):
    rng = random.Random(seed)
    tps = rng.choice((1, 3))
    rid, prompt, used = _generate(stack, seed, tps, at_least=4)
    want, groups = _oracle(model, prompt, used, tps, 70, 4)
    committed = [p for g in groups for p in g.positions]
    targets = sorted(rng.sample(committed, 4))   # across the block edge at 64 as often as not
    r = _post(stack, "/v1/attributions/inputs", {"request_id": rid, "positions": targets, "n_steps": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["n_steps"] == 4 and [t["position"] for t in body["targets"]] != [] and \
        sorted(t["position"] for t in body["targets"]) == targets, f"seed={seed}: {body['targets']}"
    for t in body["targets"]:
        n = want.positions.index(t["position"])
        row = want.attributions[n]
        scale = max(row.abs().max().item(), 1e-6)
        assert t["token"] == want.tokens[n] and t["commit_order"] == want.orders[n], f"seed={seed}"
        # inputs: the prompt and every position committed before the target's step
        before = {p for g in groups if g.order < t["commit_order"] for p in g.positions}
        assert {s["position"] for s in t["inputs"]} == set(range(len(prompt))) | before, f"seed={seed}"
        for s in t["inputs"]:
            assert abs(s["score"] - row[s["position"]].item()) <= 1e-4 * scale, \
                f"seed={seed} target {t['position']} input {s['position']}: {s['score']} vs {row[s['position']].item()}"
        total = sum(s["score"] for s in t["inputs"])
        assert abs(sum(s["normalized"] for s in t["inputs"]) - (1.0 if abs(total) > 1e-6 else 0.0)) < 1e-3, f"seed={seed}"
    ranked = [x["score"] for x in body["summary"]["prompt"]]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == len(prompt), f"seed={seed}"


def test_streamed_chunk_attribution_reports_progress(stack, seed):
    rid, prompt, _ = _generate(stack, seed + 1, 2, max_tokens=20, at_least=8)
    events = []
    with httpx.stream("POST", f"{stack.base_url}/v1/attributions/inputs", timeout=120, json={
            "request_id": rid, "chunk": {"start": len(prompt), "end": len(prompt) + 8}, "n_steps": 2,
            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    kinds = [e["object"].rsplit(".", 1)[1] for e in events]
    assert kinds[0] == "progress" and kinds[-1] == "summary", kinds
    done = [e["done"] for e in events if e["object"].endswith("progress")]
    assert done == sorted(done) and done[-1] == events[0]["total"] == kinds.count("target") == 8, (seed, done, kinds)


@pytest.mark.parametrize("body,status,param", [
    ({"request_id": "nope", "positions": [5]}, 404, None),
    ({"request_id": "{rid}", "positions": [0]}, 400, "positions"),        # a prompt position: nothing committed it
    ({"request_id": "{rid}", "positions": [9999]}, 400, "positions"),     # past the request's tokens
    ({"request_id": "{rid}", "positions": [9], "n_steps": 0}, 400, "n_steps"),
    ({"request_id": "{rid}", "positions": [9], "n_steps": 300}, 400, "n_steps"),
    ({"request_id": "{rid}"}, 400, "positions"),
    ({"request_id": "{rid}", "chunk": {"start": 9, "end": 9}}, 400, "chunk.end"),
    ({"request_id": "{rid}", "positions": list(range(65))}, 400, "positions"),
])
def test_bad_input_attribution_requests_are_refused_clearly(stack, seed, body, status, param):
    rid, _, _ = _generate(stack, seed, 1, max_tokens=8, at_least=8)
    body = {k: (v.format(rid=rid) if isinstance(v, str) else v) for k, v in body.items()}
    r = _post(stack, "/v1/attributions/inputs", body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_a_steered_request_is_explained_with_its_injection(stack, model, seed):
    """Beyond the package: the served attribution of a steered request replays the steering the
    worker applied (the PreparedSteering stored with the request), not the unsteered model."""
    import redis

    from scheduler_svc.spec import decode_spec
    from worker_svc.block_diffusion import prepared_steering

    prompt_text = "The sea"
    r = _post(stack, "/v1/completions", {"prompt": prompt_text, "max_tokens": 12, "seed": seed,
                                         "steering": {"concepts": [{"name": "ocean"}]}})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("cmpl-")
    spec, _ = decode_spec(redis.Redis.from_url(stack.redis.url).hget(f"cde:req:{rid}", "spec").decode())
    assert spec.HasField("steering"), "the request was not steered"
    steering = prepared_steering(spec.steering, model.cfg, spec.model)
    prompt = list(spec.prompt_tokens)
    opts = decode_options(12, sampling=SamplingParams(), tokens_per_step=1, seed=seed)
    res = generate(model, prompt, opts, steering, tokenizer_vocab_size=264)
    groups = commit_groups(res.steps)
    steered = attribute(model, prompt, len(prompt) + 12, groups, 4, steering)
    plain = attribute(model, prompt, len(prompt) + 12, groups, 4)
    targets = [p for g in groups for p in g.positions][:3]
    got = _post(stack, "/v1/attributions/inputs", {"request_id": rid, "positions": targets, "n_steps": 4}).json()
    for t in got["targets"]:
        n = steered.positions.index(t["position"])
        scale = steered.attributions[n].abs().max().item()
        served = torch.tensor([s["score"] for s in t["inputs"]])
        idx = torch.tensor([s["position"] for s in t["inputs"]])
        assert (served - steered.attributions[n, idx]).abs().max().item() <= 1e-4 * scale, f"seed={seed}"
    assert (steered.attributions - plain.attributions).abs().max().item() > 1e-3 * scale, \
        f"seed={seed}: steering changed no attribution (the test could not tell them apart)"
