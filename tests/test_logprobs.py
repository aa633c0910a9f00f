"""Logprobs, echo and the tokenizer endpoints, served, and lm-eval as a real client.

Oracles: a causal model's logprobs are `cde/qwen3/loglikelihood.py` on the same checkpoint
(itself equal to transformers' log-softmax, tests/test_qwen3_loglikelihood.py); a block-diffusion
model's echo loglikelihood is the public package's lm-eval wrapper
(`SteerlingLM._compute_mc_loglikelihood`) on the package's model with the bundled weights, after
`torch.manual_seed(seed)`. Both stacks are real processes (Redis, scheduler, worker, gateway; for
Steerling also steering and attribution)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import grpc
import httpx
import jsonschema
import pytest
import torch

from cde.qwen3.chat import load_chat_tokenizer
from cde.rpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc
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


def _grpc_generate(stack, request) -> tuple[list, object]:
    """(events, None) or ([], (code, details, trailing metadata)) of one public gRPC Generate."""
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports['gateway_grpc']}") as ch:
            try:
                return [ev async for ev in generate_pb2_grpc.GenerationStub(ch).Generate(request, timeout=120)], None
            except grpc.aio.AioRpcError as e:
                return [], (e.code(), e.details(), {k: v for k, v in (e.trailing_metadata() or ())})
    return asyncio.run(run())


@pytest.mark.e2e
@pytest.mark.parity
def test_grpc_block_events_carry_the_models_logprobs(idlm, steerling, seed):
    """gRPC `logprobs` / `top_logprobs`: every BlockEvent carries its tokens' scores, equal to the
    model's log-softmax given everything before each token (the REST oracle above); refused with
    INVALID_ARGUMENT naming the field where REST answers 400."""
    stack, model, _ = idlm
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(3, 20))]
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), logprobs=True, top_logprobs=3,
                                       decode=common_pb2.DecodeOptions(max_new_tokens=9, seed=seed))
    events, err = _grpc_generate(stack, req)
    assert err is None, f"seed={seed}: {err}"
    blocks = [e.block for e in events if e.HasField("block")]
    out = [t for b in blocks for t in b.tokens]
    assert out and all(len(b.logprobs) == len(b.tokens) for b in blocks), f"seed={seed}"
    want = token_logprobs(model, prompt + out, top=3)[len(prompt):]
    for i, (got, w) in enumerate(zip([s for b in blocks for s in b.logprobs], want)):
        assert _close(got.logprob, w.logprob), f"seed={seed} token {i}: {got.logprob} vs {w.logprob}"
        assert list(got.top_ids) == [t for t, _ in w.top], f"seed={seed} token {i}"
        assert all(_close(g, v) for g, (_, v) in zip(got.top_logprobs, w.top)), f"seed={seed} token {i}"
    for target, extra, param in [(stack, {"top_logprobs": 2}, "top_logprobs"),
                                 (stack, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                 (steerling, {"top_logprobs": 21, "logprobs": True}, "top_logprobs")]:
        bad = generate_pb2.GenerateRequest(prompt="hi there", decode=common_pb2.DecodeOptions(max_new_tokens=2), **extra)
        _, err = _grpc_generate(target, bad)
        assert err is not None and err[0] == grpc.StatusCode.INVALID_ARGUMENT and err[2].get("cde-param") == param, \
            (extra, err)


@pytest.mark.e2e
@pytest.mark.parity
def test_steerling_generated_logprobs_are_the_committing_steps_distribution(steerling, seed):
    """A block-diffusion model's generated-token logprobs: each token's log-softmax at the
    position and step that committed it, replayed through the public package's model on the
    snapshot the engine saw (prompt, the tokens committed at earlier steps, masks), from the
    served step events; the same numbers non-streamed, in a chat response and over gRPC."""
    cfg, oracle = _package_steerling(seed)
    body = {"prompt": "Tell me about the sea.", "max_tokens": 70, "logprobs": 3, "seed": seed, "stop_token_ids": []}
    chunks = _sse(steerling, "/v1/completions", body | {"stream_mode": "steps"})
    steps = [c["cde"] for c in chunks if c.get("object") == "cde.step"]
    served = [(t, v, top) for c in chunks for ch in c.get("choices", ()) if ch.get("logprobs")
              for t, v, top in zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"], ch["logprobs"]["top_logprobs"])]
    prompt = load_model_tokenizer(cfg, STEERLING_DIR).encode("Tell me about the sea.")
    gen_end = len(prompt) + 70
    seq = torch.tensor(prompt + [cfg.mask_id] * 70)
    want = {}
    with torch.no_grad():
        for s in steps:
            end = min((s["positions"][0] // 64 + 1) * 64, gen_end)
            logp = oracle(seq[:end][None], minimal_output=True)[0][0].float().log_softmax(-1)
            for p, t in zip(s["positions"], s["tokens"]):
                want[p] = (float(logp[p, t]), logp[p].topk(3).values.tolist())
            for p, t in zip(s["positions"], s["tokens"]):
                seq[p] = t
    out_positions = []
    for p in range(len(prompt), gen_end):
        if int(seq[p]) == cfg.eot_id:   # the response ends before it
            break
        if int(seq[p]) not in (cfg.mask_id, cfg.eos_id):
            out_positions.append(p)
    assert len(served) == len(out_positions) > 0, f"seed={seed}: {len(served)} served, {len(out_positions)} generated"
    for (text, got, top), p in zip(served, out_positions):
        w, w_top = want[p]
        assert abs(got - w) <= 1e-4 * max(1.0, abs(w)), f"seed={seed} position {p}: served {got}, package {w}"
        assert abs(max(top.values()) - w_top[0]) <= 1e-4 * max(1.0, abs(w_top[0])), f"seed={seed} position {p}"
    plain = _post(steerling, "/v1/completions", body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["logprobs"]["token_logprobs"] == [v for _, v, _ in served], f"seed={seed}"
    chat = _post(steerling, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                                                     "logprobs": True, "top_logprobs": 2, "seed": seed})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content), chat.text
    events, err = _grpc_generate(steerling, generate_pb2.GenerateRequest(
        prompt="Tell me about the sea.", logprobs=True, top_logprobs=3, decode=common_pb2.DecodeOptions(
            max_new_tokens=70, seed=seed, stop_ids=[])))
    assert err is None, f"seed={seed}: {err}"
    grpc_lp = [s.logprob for e in events if e.HasField("block") for s in e.block.logprobs]
    assert len(grpc_lp) == len(served) and all(abs(g - v) <= 1e-6 * max(1.0, abs(v)) for g, (_, v, _) in zip(grpc_lp, served)), \
        f"seed={seed}: gRPC {grpc_lp} vs REST {[v for _, v, _ in served]}"


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
    for body, param in [({"prompt": "hi there", "logprobs": 1, "echo_context_tokens": 1}, "echo_context_tokens"),
                        ({"prompt": "hi there", "logprobs": 1, "echo": True}, "echo_context_tokens"),
                        ({"prompt": "hi there", "logprobs": 1, "echo": True, "echo_context_tokens": 99},
                         "echo_context_tokens"),
                        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
                         "top_logprobs")]:
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
        # the context unscored; the generated token scored at its committing step (not part of the ELBO)
        assert lp["token_logprobs"][:ctx_len] == [None] * ctx_len and lp["token_logprobs"][-1] <= 0
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



@pytest.mark.e2e
def test_a_causal_model_serves_structured_output_with_isd(idlm, seed):
    """response_format on a causal model: ISD (the default stride) and AR outputs match the schema /
    regex; greedy ISD equals greedy AR under the grammar (exactness); a bad regex is 400."""
    stack, _, _ = idlm
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    texts = {}
    for stride in (1, 4):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 0,
                "response_format": fmt, "decode": {"stride": stride}}
        r = _post(stack, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        texts[stride] = choice["message"]["content"]
    assert texts[1] == texts[4], f"greedy ISD under the grammar differs from greedy AR: {texts}"
    for i in range(3):
        r = _post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 40, "seed": seed + i,
                                              "response_format": {"type": "regex", "regex": "[a-z]{3,8}-[0-9]{2}"}})
        assert r.status_code == 200, r.text
        assert re.fullmatch("[a-z]{3,8}-[0-9]{2}", r.json()["choices"][0]["text"]), r.text
    r = _post(stack, "/v1/completions", {"prompt": "x", "response_format": {"type": "regex", "regex": "[a-"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.regex", r.text
