"""`n` > 1 on a real stack (steerling-tiny): choice i is the n = 1 request with seed + i, streamed
or not; usage counts the prompt once; bounds."""

from __future__ import annotations

import random

import httpx
import pytest

from cde import limits as L
from cde.sse import is_sse_done, parse_sse_line
from tests.stack_fixture import running_stack, wait_until


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("choices")) as s:
        yield s


def _post(stack, path, body):
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=120)


@pytest.mark.e2e
def test_n_choices_are_the_single_requests_with_consecutive_seeds(stack, seed):
    rng = random.Random(seed)
    s = rng.randrange(L.SEED_MAX - 8)
    n = 3
    body = {"prompt": "Tell me about the sea.", "max_tokens": 70, "seed": s}   # past one 64-token block
    singles = []
    for i in range(n):
        r = _post(stack, "/v1/completions", body | {"seed": s + i})
        assert r.status_code == 200, r.text
        singles.append(r.json())
    many = _post(stack, "/v1/completions", body | {"n": n})
    assert many.status_code == 200, many.text
    m = many.json()
    assert [c["index"] for c in m["choices"]] == list(range(n))
    assert [c["text"] for c in m["choices"]] == [x["choices"][0]["text"] for x in singles], f"seed={seed} s={s}"
    assert [c["seed"] for c in m["cde"]["choices"]] == [s + i for i in range(n)]
    assert len({c["text"] for c in m["choices"]}) > 1, f"seed={seed}: sampled choices all equal"
    assert m["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert m["usage"]["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in singles)

    # streamed: one id, every chunk names its choice, each choice's text as above, one usage chunk at the end
    texts, ids, usage = [""] * n, set(), []
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=120,
                      json=body | {"n": n, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if is_sse_done(line):
                break
            obj = parse_sse_line(line)
            if obj is None:
                continue
            assert "error" not in obj, obj
            ids.add(obj["id"])
            if obj.get("usage"):
                usage.append(obj["usage"])
            for c in obj["choices"]:
                texts[c["index"]] += c.get("text") or ""
    assert texts == [c["text"] for c in m["choices"]], f"seed={seed} s={s}"
    assert len(ids) == 1 and usage == [m["usage"]]

    # greedy: the choices are the same text; bounds
    g = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                               "temperature": 0, "n": 2}).json()
    assert g["choices"][0]["message"] == g["choices"][1]["message"]
    for bad, param in [({"n": L.N_MAX + 1}, "n"), ({"n": 0}, "n"), ({"best_of": L.BEST_OF_MAX + 1}, "best_of")]:
        r = _post(stack, "/v1/completions", body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _prefix_hits(stack) -> float:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cde:prefix_cache_hits_total{"))


@pytest.mark.e2e
def test_n_choices_prefill_the_prompt_once(stack, seed):
    """n = 4 choices of a fresh 140-token prompt (2 full blocks): the worker prefills them once and
    the other three take both blocks from the prefix cache (the gateway's prefix cache counters
    rise by 3 x 128 tokens), and the texts are still the single requests'."""
    rng = random.Random(seed)
    prompt = "".join(chr(rng.randrange(97, 123)) for _ in range(140))
    body = {"prompt": prompt, "max_tokens": 20, "seed": rng.randrange(1 << 40)}
    before = _prefix_hits(stack)
    many = _post(stack, "/v1/completions", body | {"n": 4})
    assert many.status_code == 200, many.text
    wait_until(lambda: _prefix_hits(stack) - before >= 3 * 128, 15, 0.3, "prefix cache hits of the choices")
    assert _prefix_hits(stack) - before == 3 * 128, f"seed={seed}"
    single = _post(stack, "/v1/completions", body | {"seed": body["seed"] + 3}).json()
    assert many.json()["choices"][3]["text"] == single["choices"][0]["text"], f"seed={seed}"
