"""`worker_svc --tensor-parallel 2` through the stack (real processes, gloo on loopback): a worker
whose model is split over two ranks in lockstep (worker_svc/tensor_parallel.py) serves what a
one-process worker serves. The oracle is a second stack with a plain worker on the same
checkpoint: the same requests (steered and attributed, sampled and greedy, multi-token, chat and
completions; for the causal model ISD and AR, and logprobs, which take the scoring path every
rank runs between steps) give the same tokens, and the attributions agree to float32 rounding
(the ranks' all-reduce sums the partial products in another order than one GEMM). Then the
failure contract: a follower rank killed makes the worker exit (the launcher restarts it), and
a killed rank 0 takes its follower down with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.stack_fixture import running_stack

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-3

# The steered request injects gently (target 2 from layer 3): at the defaults (target 8 from layer 1) the
# tiny random model's masked positions become near copies of each other, their confidences tie, and which
# one commits first is decided by float32 rounding, which the ranks' reduction order changes.
STEERLING_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48,
                              "seed": 5, "attribution": "tokens",
                              "steering": {"concepts": [{"name": "ocean"}], "target": 2.0, "inject_layer": 3}}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "seed": 1,
                         "attribution": "tokens", "decode": {"tokens_per_step": 2}}),
    ("/v1/completions", {"prompt": "The river", "max_tokens": 70, "seed": 9, "temperature": 0.8}),
]
CAUSAL_REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 32,
                              "temperature": 0, "decode": {"stride": 4}}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.9, "seed": 3,
                         "decode": {"stride": 2}, "logprobs": 2}),
    ("/v1/completions", {"prompt": "The river", "max_tokens": 16, "temperature": 0, "decode": {"stride": 1},
                         "logprobs": 1, "echo": True, "stop_token_ids": []}),
]


def _serve(stack, requests) -> list[dict]:
    out = []
    with httpx.Client(timeout=180) as c:
        for path, body in requests:
            r = c.post(f"{stack.base_url}{path}", json=body)
            assert r.status_code == 200, (path, r.text)
            out.append(r.json())
    return out


def _tokens(resp: dict) -> list[int]:
    return [t for b in resp["cde"]["blocks"] for t in b["tokens"]]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
        except FileNotFoundError:
            return True
        if status == "Z":   # exited, not reaped yet
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("model", ["steerling-tiny", "idlm-tiny"])
def test_a_two_rank_worker_serves_what_a_one_process_worker_serves(tmp_path, model):
    requests = STEERLING_REQUESTS if model == "steerling-tiny" else CAUSAL_REQUESTS
    model_dir = ROOT / "models" / model
    with running_stack(tmp_path / "one", model_dir=model_dir) as stack:
        want = _serve(stack, requests)
    with running_stack(tmp_path / "tp", model_dir=model_dir, tensor_parallel=2) as stack:
        log = next(s for s in stack.services if s.name == "worker0")
        assert "tensor parallel over 2 ranks" in log.log.read_text(), log.log.read_text()[-2000:]
        got = _serve(stack, requests)
        info = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]
        worker_pid = log.proc.pid
        followers = _children(worker_pid)
        assert len(followers) == 1, followers

        for (path, body), g, w in zip(requests, got, want):
            tag = f"{model} {path} {body.get('seed')}"
            assert _tokens(g) == _tokens(w), tag
            assert g["choices"][0].get("text", g["choices"][0].get("message", {}).get("content")) == \
                w["choices"][0].get("text", w["choices"][0].get("message", {}).get("content")), tag
            for ga, wa in zip(g["cde"].get("token_attributions") or [], w["cde"].get("token_attributions") or []):
                gs = {c["concept_id"]: c["score"] for c in ga["top"]}
                ws = {c["concept_id"]: c["score"] for c in wa["top"]}
                common = gs.keys() & ws.keys()   # a near-tie at the cut may swap the last listed one
                assert len(common) >= len(ws) - 1 and all(_close(gs[c], ws[c]) for c in common), tag
                assert _close(ga["target_logit"], wa["target_logit"]) and _close(ga["residual"], wa["residual"]), tag
            if body.get("attribution"):
                assert g["cde"]["token_attributions"], tag
            if body.get("logprobs"):
                glp, wlp = g["choices"][0]["logprobs"], w["choices"][0]["logprobs"]
                assert glp["tokens"] == wlp["tokens"], tag
                for a, b in zip(glp["token_logprobs"], wlp["token_logprobs"]):
                    assert (a is None and b is None) or _close(a, b), tag

        # a follower rank killed: its shard is gone, so the worker exits (and the launcher would restart it)
        os.kill(followers[0], signal.SIGKILL)
        assert _wait_gone(worker_pid, 30), "rank 0 outlived its follower"
    assert info["id"] == model


def test_a_killed_rank_zero_takes_its_follower_with_it(tmp_path):
    with running_stack(tmp_path / "tp", tensor_parallel=2) as stack:
        worker = next(s for s in stack.services if s.name == "worker0")
        followers = _children(worker.proc.pid)
        assert len(followers) == 1
        os.kill(worker.proc.pid, signal.SIGKILL)
        assert _wait_gone(followers[0], 30), "the follower outlived rank 0"


def test_a_model_the_ranks_cannot_split_is_refused_with_the_sizes(tmp_path):
    """steerling-small has 5 heads and 1 KV head: two ranks cannot split it; the worker says so."""
    import subprocess
    import sys

    from cde.redis_util import free_port

    proc = subprocess.run([sys.executable, "-m", "worker_svc", "--model-dir", str(ROOT / "models" / "steerling-small"),
                           "--port", str(free_port()), "--tensor-parallel", "2", "--threads", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "divisible by 2" in proc.stderr and "n_head (5)" in proc.stderr, proc.stderr[-2000:]
