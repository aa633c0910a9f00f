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
    assert {"bench.steerling", "bench.isd", "train.eval_idlm"} <= set(modules), modules
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert not missing, f"bench/run_h200.sh runs modules that do not exist: {missing}"
