"""`cde.launch --devices`: one worker per listed GPU index, each process given
CUDA_VISIBLE_DEVICES=<its index> (so it sees that GPU as cuda:0). Run here with --device cpu: the
variable is set all the same, both workers register and serve; contradicting flags are refused
before anything starts."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from cde.launch import ROOT
from tests.launcher_fixture import launched
from tests.stack_fixture import wait_until


def _workers_registered(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cde:num_workers{"))


@pytest.mark.e2e
def test_devices_start_one_pinned_worker_each(tmp_path):
    with launched(tmp_path, "--devices", "0,1", "--device", "cpu") as st:
        for i in (0, 1):
            assert st.environ(f"worker{i}").get("CUDA_VISIBLE_DEVICES") == str(i), st.environ(f"worker{i}")
            argv = st.argv(f"worker{i}")
            assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--worker-id") + 1] == f"w{i}"
        assert "CUDA_VISIBLE_DEVICES" not in st.environ("gateway")
        wait_until(lambda: _workers_registered(st.base_url) == 2, 60, 0.3, "both workers registered")
        r = httpx.post(f"{st.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=120)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("flags, message", [(["--devices", "0,0"], "distinct GPU indices"),
                                            (["--devices", "0,a"], "distinct GPU indices"),
                                            (["--devices", "0,1", "--workers", "3"], "contradicts --devices")])
def test_bad_devices_are_refused_before_anything_starts(tmp_path, flags, message):
    r = subprocess.run([sys.executable, "-m", "cde.launch", "--run-dir", str(tmp_path / "run"), "--device", "cpu",
                        *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stdout + r.stderr, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
