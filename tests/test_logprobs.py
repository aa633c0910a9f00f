"""Logprobs, echo and the tokenizer endpoints, served, and lm-eval as a real client.

Oracles: a causal model's logprobs are `cde/qwen3/loglikelihood.py` on the same checkpoint
(itself equal to transformers' log-softmax, tests/test_qwen3_loglikelihood.py); a block-diffusion
model's echo loglikelihood is the public package's lm-eval wrapper
(`SteerlingLM._compute_mc_loglikelihood`) on the package's model with the bundled weights, after
`torch.manual_seed(seed)`. Both stacks are real processes (Redis, scheduler, worker, gateway; for
Steerling also steering and attribution)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
import torch

from cde.qwen3.chat import load_chat_tokenizer
from cde.qwen3.loading import load_qwen3
from cde.qwen3.loglikelihood import loglikelihood, token_logprobs
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import load_model
from cde.steerling.tokenizer import load_model_tokenizer
from cde.sse import is_sse_done, parse_sse_line
from tests.oracle import build_oracle
from tests.stack_fixture import running_stack

ROOT = Path(__file__).resolve().parents[1]
IDLM_DIR = ROOT / "models" / "idlm-tiny"
STEERLING_DIR = ROOT / "models" / "steerling-tiny"
TOL = 2e-5   # served values are float32, rounded to 7 significant digits


@pytest.fixture(scope="module")
def idlm(tmp_path_factory):
    model = load_qwen3(IDLM_DIR, dtype=torch.float32, device="cpu")
    with running_stack(tmp_path_factory.mktemp("idlm"), model_dir=IDLM_DIR) as stack:
        yield stack, model, load_chat_tokenizer(IDLM_DIR, model.cfg)


@pytest.fixture(scope="module")
def steerling(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("steerling"), model_dir=STEERLING_DIR) as stack:
        yield stack


def _post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=120)


def _sse(stack, path: str, body: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", f"{stack.base_url}{path}", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if is_sse_done(line):
                break
            obj = parse_sse_line(line)
            if obj is not None:
                out.append(obj)
    return out


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL * max(1.0, abs(want))


@pytest.mark.e2e
@pytest.mark.parity
def test_causal_echo_and_generated_logprobs_equal_the_models(idlm, seed):
    stack, model, tok = idlm
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 20))]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True, "seed": seed,
            "stop_token_ids": []}
    r = _post(stack, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    out = [t for b in r.json()["cde"]["blocks"] for t in b["tokens"]]
    lp = choice["logprobs"]
    want = token_logprobs(model, prompt + out, top=3)
    assert len(lp["token_logprobs"]) == len(prompt) + len(out), f"seed={seed}"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, (w, got, top) in enumerate(zip(want[1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]), 1):
        assert _close(got, w.logprob), f"seed={seed} token {i}: served {got} vs model {w.logprob}"
        texts = {tok.token_bytes(t).decode("utf-8", "replace") for t, _ in w.top} | {lp["tokens"][i]}
        assert set(top) == texts, f"seed={seed} token {i}: top {sorted(top)} vs {sorted(texts)}"
        assert _close(max(top.values()), w.top[0][1]), f"seed={seed} token {i}"
    assert choice["text"].startswith(tok.decode(prompt, skip_special=False))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]

    # the same generated logprobs without echo, streamed, and in a chat response
    chunks = _sse(stack, "/v1/completions", body | {"echo": False})
    streamed = [v for c in chunks for ch in c["choices"] if ch.get("logprobs") for v in ch["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(out) and all(_close(g, w.logprob) for g, w in zip(streamed, want[len(prompt):])), \
        f"seed={seed}: streamed {streamed}"
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    chat = _post(stack, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": 2, "seed": seed})
    assert chat.status_code == 200, chat.text
    cprompt = tok.apply_chat_template(msgs)
    cout = [t for b in chat.json()["cde"]["blocks"] for t in b["tokens"]]
    content = chat.json()["choices"][0]["logprobs"]["content"]
    cwant = token_logprobs(model, cprompt + cout, top=2)[len(cprompt):]
    assert len(content) == len(cout) and all(len(c["top_logprobs"]) == 2 for c in content)
    for c, w in zip(content, cwant):
        assert _close(c["logprob"], w.logprob) and _close(c["top_logprobs"][0]["logprob"], w.top[0][1]), f"seed={seed}"
        assert bytes(c["bytes"]).decode() == c["token"]


@pytest.mark.e2e
@pytest.mark.contract
def test_logprob_fields_are_checked_and_the_tokenizer_endpoints_answer(idlm, steerling):
    stack, model, tok = idlm
    bad = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "echo": True, "echo_context_tokens": 1},
         "echo_context_tokens"),
    ]
    for path, body, param in bad:
        r = _post(stack, path, body | {"max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for body, param in [({"prompt": "hi there", "logprobs": 1}, "logprobs"),            # generated: not served
                        ({"prompt": "hi there", "logprobs": 1, "echo": True}, "echo_context_tokens"),
                        ({"prompt": "hi there", "logprobs": 1, "echo": True, "echo_context_tokens": 99},
                         "echo_context_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs")]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(steerling, path, body | {"max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

    text = "Tell me <|im_end|> about the sea."
    ids = _post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode(text) and ids["count"] == len(ids["tokens"])
    assert _post(stack, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == text
    r = _post(stack, "/detokenize", {"tokens": [1, tok.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    info = httpx.get(f"{stack.base_url}/tokenizer_info", timeout=30).json()
    assert info["eos_token_id"] in tok.stop_ids and info["model_max_length"] == model.cfg.max_positions
    chat_ids = _post(stack, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat_ids == tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _package_steerling(seed: int):
    """The public package's model with the bundled steerling-tiny weights, and ours."""
    cfg = SteerlingConfig.load(STEERLING_DIR)
    ours = load_model(STEERLING_DIR, dtype=torch.float32, device="cpu")
    oracle = build_oracle(cfg, seed)
    oracle.load_state_dict(ours.state_dict(), strict=True)
    return cfg, oracle.eval()


def _package_loglikelihood(cfg, oracle, context: list[int], continuation: list[int], draw: int) -> float:
    from steerling.evaluation.lm_harness_wrapper import SteerlingLM

    lm = object.__new__(SteerlingLM)
    lm.model, lm.is_interpretable, lm.mask_token_id = oracle, True, cfg.mask_id
    lm.mc_num, lm.mc_batch_size, lm.cfg = 128, 32, 0.0
    lm._torch_device = torch.device("cpu")
    torch.manual_seed(draw)
    return lm._compute_mc_loglikelihood(context, continuation)[0]


@pytest.mark.e2e
@pytest.mark.parity
def test_steerling_echo_loglikelihood_equals_the_packages_lm_eval_wrapper(steerling, seed):
    cfg, oracle = _package_steerling(seed)
    tok = load_model_tokenizer(cfg, STEERLING_DIR)
    rng = random.Random(seed)
    for ctx_len, cont_len in [(5, 4), (70, 9)]:   # inside the first block, and past it
        context = tok.encode("The sea was calm. " * 8)[:ctx_len]
        continuation = [rng.randrange(0, 256) for _ in range(cont_len)]
        draw = rng.randrange(1 << 31)
        r = _post(steerling, "/v1/completions", {"prompt": context + continuation, "max_tokens": 1, "echo": True,
                                                 "logprobs": 1, "echo_context_tokens": ctx_len, "seed": draw})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        scored = lp["token_logprobs"][ctx_len:ctx_len + cont_len]
        assert lp["token_logprobs"][:ctx_len] == [None] * ctx_len and lp["token_logprobs"][-1] is None
        want = _package_loglikelihood(cfg, oracle, context, continuation, draw)
        got = sum(scored)
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), \
            f"seed={seed} draw={draw} context {ctx_len}: served {got} vs package {want}"


@pytest.mark.e2e
def test_lm_eval_runs_against_both_models(idlm, steerling, seed):
    """lm-eval's own `local-completions` (remote tokenizer) on the causal model, ours
    (`cde-completions`) on the block-diffusion one: loglikelihood and generate_until requests
    end to end, the scores equal the oracles'."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from cde.lm_eval_client import register

    stack, model, tok = idlm
    register()
    pairs = [("The sea was", " calm"), ("Once upon a time", " there was a ship"), ("Hello", ",")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    lm = get_model("local-completions")(base_url=f"{stack.base_url}/v1/completions", model="idlm-tiny",
                                        tokenizer_backend="remote", max_retries=1)
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (score, _greedy) in zip(pairs, got):
        want, _ = loglikelihood(model, tok.encode(ctx), tok.encode(ctx + cont)[len(tok.encode(ctx)):])
        assert _close(score, want), f"seed={seed} {ctx!r}+{cont!r}: lm-eval {score} vs model {want}"
    gen = [Instance(request_type="generate_until", doc={}, idx=0,
                    arguments=("The sea was", {"until": ["\n\n"], "max_gen_toks": 6, "temperature": 0}))]
    text = lm.generate_until(gen)[0]
    direct = _post(stack, "/v1/completions", {"prompt": "The sea was", "max_tokens": 6, "temperature": 0,
                                              "stop": ["\n\n"], "seed": 1234}).json()["choices"][0]["text"]
    assert text == direct, f"lm-eval {text!r} vs REST {direct!r}"

    slm = get_model("cde-completions")(base_url=f"{steerling.base_url}/v1/completions", model="steerling-tiny",
                                       max_retries=1)
    sgot = slm.loglikelihood(reqs[:2])
    cfg, oracle = _package_steerling(seed)
    stok = load_model_tokenizer(cfg, STEERLING_DIR)
    for (ctx, cont), (score, _greedy) in zip(pairs, sgot):
        c_ids = stok.encode(ctx)
        want = _package_loglikelihood(cfg, oracle, c_ids, stok.encode(ctx + cont)[len(c_ids):], 1234)
        assert abs(score - want) <= 1e-4 * max(1.0, abs(want)), f"seed={seed} {ctx!r}: {score} vs package {want}"
    print(json.dumps({"idlm": got, "steerling": sgot}))
