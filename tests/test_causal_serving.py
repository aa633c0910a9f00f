"""Serving a causal (I-DLM / Qwen3-layout) model through the same services: decode.stride.

The bundled `models/idlm-tiny` (random weights, byte-level tokenizer.json) runs as a real
stack (Redis, scheduler, worker, gateway as processes; no steering / attribution services:
the model has no concepts). The oracle is the plain full-recompute reference decoder of
cde/isd/decoder.py on the same checkpoint: greedy output through the services, at every
stride, equals its greedy AR output token for token.
"""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from cde.isd.decoder import generate_ar
from cde.model_family import CAUSAL, STEERLING, model_family
from cde.qwen3.chat import load_chat_tokenizer
from cde.qwen3.config import Qwen3Config
from cde.qwen3.loading import load_qwen3
from cde.qwen3.make_tiny import CONFIG, make_tiny
from cde.rpc.v1 import common_pb2, generate_pb2, resolved_pb2
from gateway.pipeline import ModelCard
from tests.stack_fixture import running_stack

ROOT = Path(__file__).resolve().parents[1]
IDLM_DIR = ROOT / "models" / "idlm-tiny"
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def test_committed_idlm_checkpoint_is_what_make_tiny_writes(tmp_path):
    make_tiny(tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (IDLM_DIR / name).read_bytes(), name
    assert Qwen3Config.load(IDLM_DIR) == CONFIG
    assert model_family(IDLM_DIR) == CAUSAL and model_family(ROOT / "models" / "steerling-tiny") == STEERLING


def test_chat_tokenizer_bytes_roundtrip_and_specials_never_from_text():
    tok = load_chat_tokenizer(IDLM_DIR)
    text = "héllo <|im_end|> <|MASK|> 日本 ✓"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.tok.special_ids)
    assert tok.decode_bytes(ids).decode() == text
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    assert chat[0] == tok.tok.token_to_id("<|im_start|>") and tok.mask_id not in chat
    assert tok.decode_bytes([262]) == "\ufffd".encode()   # an id the tokenizer does not assign
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


@pytest.mark.contract
def test_gateway_resolves_causal_options_and_refuses_concept_features():
    import asyncio

    from gateway.errors import GatewayError
    from gateway.metrics import GatewayMetrics
    from gateway.pipeline import Limits, Pipeline

    card = ModelCard.load(IDLM_DIR)
    assert card.causal and card.info().family == "causal" and card.max_context == CONFIG.max_positions
    pipe = Pipeline(card, backends=None, limits=Limits(), metrics=GatewayMetrics(card.id))
    d = pipe.resolve_decode(common_pb2.DecodeOptions(max_new_tokens=8), 10)
    assert d.isd.stride == 4 and d.WhichOneof("decoder") == "isd"   # no tokens_per_step: one token per ISD slot
    assert d.isd.adapter == resolved_pb2.ISD_ADAPTER_GATED
    assert pipe.resolve_decode(common_pb2.DecodeOptions(max_new_tokens=8, isd_stride=1), 10).isd.stride == 1
    s = pipe.resolve_sampling(common_pb2.SamplingOptions())
    assert (s.use_entropy_sampling, s.temperature, s.top_p, s.repetition_penalty) == (False, 1.0, 1.0, 1.0)
    assert s.top_k == 0
    bad = [
        (lambda: pipe.resolve_decode(common_pb2.DecodeOptions(max_new_tokens=8, isd_stride=9), 10), "decode.stride"),
        (lambda: pipe.resolve_decode(common_pb2.DecodeOptions(max_new_tokens=8, tokens_per_step=2), 10),
         "decode.tokens_per_step"),
        (lambda: pipe.resolve_sampling(common_pb2.SamplingOptions(repetition_penalty=1.2)), "repetition_penalty"),
        (lambda: pipe.resolve_sampling(common_pb2.SamplingOptions(use_entropy_sampling=True)), "use_entropy_sampling"),
        (lambda: asyncio.run(pipe.prepare(generate_pb2.GenerateRequest(
            prompt="hi", attribution=common_pb2.ATTRIBUTION_CHUNKS))), "attribution"),
        (lambda: asyncio.run(pipe.prepare(generate_pb2.GenerateRequest(
            prompt="hi", steering=common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="x")])))),
         "steering"),
        (lambda: asyncio.run(pipe.search_concepts(common_pb2.SearchConceptsRequest(query="sea"))), "model"),
    ]
    for call, param in bad:
        with pytest.raises(GatewayError) as e:
            call()
        assert e.value.param == param, (param, e.value.message)


REPORT_TAG = "causal"   # the `report` fixture (conftest.py) prints "[causal] ..."


def _complete(client: httpx.Client, url: str, body: dict) -> dict:
    r = client.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.e2e
@pytest.mark.parity
def test_causal_stack_greedy_isd_equals_reference_ar_at_every_stride(tmp_path, report):
    model = load_qwen3(IDLM_DIR, dtype=torch.float32)
    tok = load_chat_tokenizer(IDLM_DIR, model.cfg)
    prompt_ids = tok.apply_chat_template(PROMPT)
    want = generate_ar(model, prompt_ids, 40, temperature=0.0).tokens
    with running_stack(tmp_path / "stack", model_dir=IDLM_DIR) as stack:
        assert not any(s.name in ("steering", "attribution") for s in stack.services)
        url = stack.base_url
        with httpx.Client(timeout=120) as c:
            models = c.get(f"{url}/v1/models").json()["data"]
            assert models[0]["id"] == "idlm-tiny" and models[0]["cde"]["family"] == "causal"
            figures = {}
            for stride in (1, 2, 4, 8):
                out = _complete(c, url, {"messages": PROMPT, "max_tokens": 40, "temperature": 0,
                                         "decode": {"stride": stride}, "seed": 3})
                toks = [t for b in out["cde"]["blocks"] for t in b["tokens"]]
                assert toks == want[:_stop_cut(want, tok)], stride
                # the text: the reference's bytes (an unfinished last character is held back)
                text = out["choices"][0]["message"]["content"]
                full = tok.decode_bytes(toks).decode("utf-8", "replace")
                assert full.startswith(text) and len(full) - len(text) <= 1, stride
                cde = out["cde"]
                assert cde["forwards"] >= 1 and cde["isd_acceptance"] is not None
                if stride == 1:
                    assert cde["tokens_per_forward"] <= 1.0 + 1e-6
                figures[stride] = (cde["tokens_per_forward"], cde["isd_acceptance"])
            # sampled, seeded: the same seed gives the same text; streaming gives the same text too
            body = {"messages": PROMPT, "max_tokens": 48, "temperature": 0.8, "top_p": 0.95, "seed": 11,
                    "decode": {"stride": 4}}
            a = _complete(c, url, body)["choices"][0]["message"]["content"]
            b = _complete(c, url, body)["choices"][0]["message"]["content"]
            assert a == b
            streamed = []
            with c.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for ch in json.loads(line[6:])["choices"]:
                            streamed.append(ch.get("delta", {}).get("content") or "")
            assert "".join(streamed) == a
            check_usage_counts_the_response(c, url, tok, model.cfg.mask_token_id)
            # refusals are 400s with the parameter named
            for extra, param in (({"attribution": "chunks"}, "attribution"),
                                 ({"decode": {"stride": 99}}, "decode.stride")):
                r = c.post(f"{url}/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 4, **extra})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            metrics = c.get(f"{url}/metrics").text
            assert "cde:tokens_per_forward_count" in metrics and "cde:isd_acceptance_rate_count" in metrics
        # the CLI client finds out the model is causal (no attribution by default) and passes the stride
        cli = subprocess.run([sys.executable, "-m", "cde.client", "--url", url, "generate", "Tell me about the sea.",
                              "--stride", "4", "--temperature", "0", "--max-tokens", "24"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert cli.returncode == 0 and "tokens per forward" in cli.stdout, (cli.stdout, cli.stderr)
    report("causal stack: greedy tokens identical to reference AR at strides 1/2/4/8; tokens/forward, acceptance "
           + ", ".join(f"N={n}: {tpf:.2f}, {acc:.2f}" for n, (tpf, acc) in figures.items()))


def tokens_covering(tok, tokens: list[int], text: str) -> int:
    """The shortest prefix of tokens whose decoded text holds `text` (what usage must count after a
    stop string), found by decoding prefixes (an unfinished last character is not text yet)."""
    for n in range(len(tokens) + 1):
        decoded = codecs.getincrementaldecoder("utf-8")("replace").decode(tok.decode_bytes(tokens[:n]), final=False)
        if len(decoded) >= len(text):
            return n
    raise AssertionError(f"the tokens never hold the returned text {text!r}")


def check_usage_counts_the_response(c: httpx.Client, url: str, tok, mask_id: int) -> None:
    """Sampled ISD (T 0.7, top_p 0.95) over 20 seeds: usage == the tokens of the response, streamed
    and not, and none of them the mask; with a stop string, the tokens of the returned text."""
    base = {"messages": PROMPT, "max_tokens": 40, "temperature": 0.7, "top_p": 0.95, "decode": {"stride": 4}}
    for seed in range(100, 120):
        out = _complete(c, url, {**base, "seed": seed})
        toks = [t for b in out["cde"]["blocks"] for t in b["tokens"]]
        assert mask_id not in toks, f"seed={seed}: the mask id was sampled"
        assert out["usage"]["completion_tokens"] == len(toks), f"seed={seed}: usage {out['usage']} vs {len(toks)}"
        streamed, usage = [], None
        with c.stream("POST", f"{url}/v1/chat/completions",
                      json={**base, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ev = json.loads(line[6:])
                    streamed += (ev.get("cde") or {}).get("tokens", [])
                    usage = ev.get("usage") or usage
        assert streamed == toks and usage["completion_tokens"] == len(toks), f"seed={seed} streamed"
        text = out["choices"][0]["message"]["content"]
        if len(text) >= 6:   # cut at a stop string taken from the middle of this very text
            stop = text[len(text) // 2:len(text) // 2 + 2]
            cut = _complete(c, url, {**base, "seed": seed, "stop": stop})
            returned = cut["choices"][0]["message"]["content"]
            assert returned == text[:text.index(stop)], f"seed={seed}"
            assert cut["usage"]["completion_tokens"] == tokens_covering(tok, toks, returned), f"seed={seed} stop"


def _stop_cut(tokens: list[int], tok) -> int:
    return next((i for i, t in enumerate(tokens) if t in tok.stop_ids), len(tokens))


@pytest.mark.fault
@pytest.mark.e2e
def test_causal_worker_killed_mid_generation_greedy_requests_finish_identically(tmp_path, report):
    """SIGKILL the busier of two workers while greedy ISD / AR requests stream: each request is
    re-placed from its stored chunks and ends with the tokens of an uninterrupted run, each
    chunk stored and streamed once."""
    import asyncio
    import time

    import redis

    from tests.stack_fixture import (StreamResult, contiguous, kill, stored_block_indices, stream_many, stream_rest,
                                     worker_info, workers)

    def body(i: int) -> dict:
        return {"model": "idlm-tiny", "messages": [{"role": "user", "content": f"Story number {i}."}],
                "max_tokens": 700, "temperature": 0, "seed": i, "stream": True,
                "decode": {"stride": (1, 2, 4)[i % 3]}}

    with running_stack(tmp_path / "stack", model_dir=IDLM_DIR, workers=2) as stack:
        url = stack.base_url
        rds = redis.Redis.from_url(stack.redis.url)
        ids = list(range(8))
        base = asyncio.run(stream_many(url, [body(i) for i in ids]))
        assert all(b.status == 200 and b.done and not b.errors for b in base), [b.errors for b in base]

        async def run_with_kill():
            results = [StreamResult() for _ in ids]
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(stream_rest(c, url, body(i), r)) for i, r in zip(ids, results)]
                deadline = time.monotonic() + 60
                while sum(1 for r in results if len(r.blocks) >= 2) < len(results) // 2:
                    assert time.monotonic() < deadline and not all(t.done() for t in tasks), "no chunks arrived"
                    await asyncio.sleep(0.002)
                infos = await asyncio.to_thread(lambda: [(w, worker_info(stack, w.grpc_port)) for w in workers(stack)])
                victim, vinfo = max(infos, key=lambda x: x[1].running)
                await asyncio.to_thread(kill, victim)
                await asyncio.wait_for(asyncio.gather(*tasks), 90)
            return results, vinfo.running

        results, on_victim = asyncio.run(run_with_kill())
        replaced = tokens = 0
        for i, ref, res in zip(ids, base, results):
            assert res.status == 200 and res.done and not res.errors, (i, res.errors)
            assert contiguous(res.blocks) and len(set(res.blocks)) == len(res.blocks), (i, res.blocks)
            assert stored_block_indices(rds, res.request_id) == res.blocks, i
            assert res.tokens == ref.tokens and res.text == ref.text and res.finish == ref.finish, i
            replaced += int(rds.hget(f"cde:req:{res.request_id}", "attempt") or 0) > 0
            tokens += len(res.tokens)
        assert on_victim >= 1 and replaced >= 1, "the kill hit nothing"
    report(f"causal worker loss: SIGKILL with {on_victim} requests on the victim, {replaced} re-placed; "
           f"{tokens} tokens (strides 1/2/4, greedy) identical to the uninterrupted runs, each chunk once")
