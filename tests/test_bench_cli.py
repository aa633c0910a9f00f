"""The H200 bench drivers run end to end on the CPU with the tiny presets (bench/run_h200.sh
calls them on the GPU; a broken import or flag would otherwise only show there), and their JSON
has the fields docs/BENCHMARKS.md names."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", module, "--preset", "tiny", "--device", "cpu", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
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
    assert d["prefill_floor"][0]["lm_head_tokens"] == 1
    assert d["joins"][0]["running_step_ms_during"]["n"] >= 1, d["joins"]
