"""Every README example is a file under examples/, run here as a subprocess against a real local
stack (cde.launch.Stack: Redis, every service, tiny models on the CPU), the way a user runs it:
base URL and gRPC target from the environment variables the examples read. Also the launcher's
start hint for each model family, and that the examples' defaults are the launcher's ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from cde.launch import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, ROOT, client_hint
from tests.stack_fixture import running_stack

EXAMPLES = ROOT / "examples"
STEERLING_EXAMPLES = ["rest_curl.sh", "openai_client.py", "cli.sh", "grpc_resume.py", "lm_eval.sh", "input_attribution.sh"]
CAUSAL_EXAMPLES = ["rest_causal_curl.sh"]
IDLM_TINY = ROOT / "models" / "idlm-tiny"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run_example(name: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    path = EXAMPLES / name
    cmd = ["bash", str(path)] if name.endswith(".sh") else [sys.executable, str(path)]
    # from outside the repo, like a user with a checkout somewhere: nothing may rely on the cwd
    proc = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def stack_env(stack) -> dict[str, str]:
    return dict(os.environ, CDE_BASE_URL=stack.base_url, PYTHON=sys.executable,
                CDE_GRPC_TARGET=f"127.0.0.1:{stack.ports['gateway_grpc']}")


def run_hint(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def sse_payloads(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


@pytest.fixture(scope="module")
def steerling_stack(tmp_path_factory):
    # the Quick start's model (the examples name it and its "sea" concept)
    with running_stack(tmp_path_factory.mktemp("examples-stack"), model_dir=ROOT / "models" / "steerling-small") as stack:
        yield stack


def test_readme_shows_every_example_and_only_existing_ones():
    readme = (ROOT / "README.md").read_text()
    files = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".sh", ".py"))
    assert files == sorted(STEERLING_EXAMPLES + CAUSAL_EXAMPLES)
    for name in files:
        assert f"examples/{name}" in readme, f"README does not show examples/{name}"
    for named in re.findall(r"examples/([\w.]+)", readme):
        assert (EXAMPLES / named).is_file(), f"README names examples/{named}, which does not exist"


# a README code block that talks to the API (then it must be the text of an examples/ file)
API_SNIPPET = re.compile(r"\$base|base_url|stub\.|GenerateRequest|cde\.client|/v1/")


def readme_code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)


def contained_in(snippet: str, text: str) -> bool:
    """`snippet` is a run of whole lines of `text`, up to a common indentation (a README block
    shows a function's body without its indent)."""
    want = textwrap.dedent(snippet).strip("\n").splitlines()
    lines = text.splitlines()
    n = len(want)
    return any(textwrap.dedent("\n".join(lines[i:i + n])).splitlines() == want
               for i in range(len(lines) - n + 1))


def test_every_readme_api_snippet_is_the_text_of_an_example():
    """What a user copies from the README is what the tests run: each API snippet appears verbatim
    (whole lines) in one of the example files, so it names the default model and concepts that exist."""
    readme = (ROOT / "README.md").read_text()
    texts = {p.name: p.read_text() for p in EXAMPLES.iterdir() if p.suffix in (".sh", ".py")}
    snippets = [b for b in readme_code_blocks(readme) if API_SNIPPET.search(b)]
    assert len(snippets) >= 5, snippets   # curl, OpenAI, CLI, gRPC (two), causal curl
    for snippet in snippets:
        assert any(contained_in(snippet, t) for t in texts.values()), \
            f"README snippet is in no examples/ file:\n{snippet}"
    assert "steerling-tiny" not in "".join(snippets)   # not the default model: 404 on a fresh stack
    for name, text in texts.items():
        if "curl " in text:   # a refused request prints the API's error body, not just curl's exit code
            assert "--fail-with-body" in text and not re.search(r"curl -\w*f", text), name


def test_example_concepts_are_steerable_concepts_of_the_default_model():
    """The concept names the examples steer with are exact catalog names of steerling-small
    (not base names that need resolving), known and steerable."""
    import pandas as pd
    labels = pd.read_parquet(ROOT / "models" / "steerling-small" / "concept_labels.parquet")
    known = labels[(labels["head"] == "known") & labels["is_steerable"]]
    names = set(known["concept_name"])
    used = set()
    for p in EXAMPLES.iterdir():
        text = p.read_text()
        used |= set(re.findall(r'"name": "([^"]+)"', text)) | set(re.findall(r'SteeringConcept\(name="([^"]+)"\)', text))
        used |= set(re.findall(r"--(?:steer|suppress) (\S+)", text))
    assert used and used <= names, sorted(used - names)


def test_example_defaults_are_the_launchers_ports():
    for name in STEERLING_EXAMPLES + CAUSAL_EXAMPLES:
        text = (EXAMPLES / name).read_text()
        port = DEFAULT_GRPC_PORT if name.startswith("grpc") else DEFAULT_HTTP_PORT
        assert f"127.0.0.1:{port}" in text, f"{name}: default is not the launcher's port {port}"


def test_input_attribution_example_explains_the_first_generated_token(steerling_stack):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    body = json.loads(run_example("input_attribution.sh", stack_env(steerling_stack)).stdout)
    (target,) = body["targets"]
    assert target["commit_order"] >= 0 and body["n_steps"] == 32, body
    # the first generated token conditioned on the prompt (and what its block committed before it)
    assert {s["position"] for s in target["inputs"]} >= set(range(target["position"])), body
    assert body["summary"]["prompt"] and abs(sum(s["normalized"] for s in target["inputs"]) - 1) < 1e-3, body


def test_rest_curl_streams_steered_chunks(steerling_stack):
    if shutil.which("curl") is None:
        pytest.skip("curl not installed")
    out = run_example("rest_curl.sh", stack_env(steerling_stack)).stdout
    assert out.rstrip().endswith("data: [DONE]"), out[-500:]
    events = sse_payloads(out)
    assert any((e.get("cde") or {}).get("chunk_attributions") for e in events), out[-2000:]
    assert events[-1]["usage"]["completion_tokens"] == 96
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    assert text


def test_openai_client_example(steerling_stack):
    out = run_example("openai_client.py", stack_env(steerling_stack)).stdout
    assert "finish: " in out and "completion_tokens=" in out, out


def test_cli_example(steerling_stack):
    out = run_example("cli.sh", stack_env(steerling_stack)).stdout
    assert out.count("[finish: ") == 2, out[-2000:]
    # each chunk's top concepts, by head (steerling-small's chunks are often led by discovered concepts)
    assert "[chunk " in out and ("Known: " in out or "Discovered: " in out), out[-2000:]
    assert re.search(r"^\s*\d+\s+known\s+ocean", out, re.M), out[-2000:]  # concepts oce


def test_grpc_resume_example(steerling_stack):
    out = run_example("grpc_resume.py", stack_env(steerling_stack)).stdout
    assert re.search(r"^accepted \S+", out, re.M) and "finished: FINISH_REASON_" in out, out
    assert re.search(r"resume after block \d+: [1-9]\d* blocks replayed, same as the first stream: True", out), out


def test_grpc_example_reads_its_target(steerling_stack):
    """A wrong target fails fast and visibly: the example really talks to the stack."""
    env = dict(stack_env(steerling_stack), CDE_GRPC_TARGET="127.0.0.1:1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "grpc_resume.py")], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "UNAVAILABLE" in proc.stderr, proc.stderr[-2000:]


def _lm_eval_acc(out: str) -> float:
    row = re.search(r"^\|cde_story_next\s*\|.*?\|acc\s*\|[^|]*\|\s*([\d.]+)\|", out, re.M)
    assert row, out[-2000:]
    return float(row.group(1))


def test_lm_eval_example(steerling_stack):
    """lm-eval through cde-completions against steerling-small: 2 items (8 loglikelihood requests)."""
    out = run_example("lm_eval.sh", stack_env(steerling_stack) | {"CDE_LIMIT": "2"}).stdout
    assert 0.0 <= _lm_eval_acc(out) <= 1.0 and "cde-completions" in out, out[-2000:]


def test_steerling_start_hint_runs(steerling_stack):
    proc = run_hint(client_hint(steerling_stack.base_url, causal=False))
    assert proc.returncode == 0 and "[chunk " in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_causal_stack_hint_and_example(tmp_path):
    with running_stack(tmp_path / "stack", model_dir=IDLM_TINY) as stack:
        assert stack.causal
        hint = run_hint(client_hint(stack.base_url, causal=True))
        assert hint.returncode == 0 and "tokens per forward" in hint.stdout, hint.stdout[-2000:] + hint.stderr[-2000:]
        # the Steerling hint is what this stack used to print: the causal model refuses it
        wrong = run_hint(client_hint(stack.base_url, causal=False))
        assert wrong.returncode == 1 and "error 400" in wrong.stderr, wrong.stdout[-1000:] + wrong.stderr[-1000:]
        out = json.loads(run_example("rest_causal_curl.sh", stack_env(stack)).stdout)
        assert out["choices"][0]["finish_reason"] in ("stop", "length") and out["cde"]["forwards"] > 0, out
        # lm-eval's own local-completions, remote tokenizer (the README's causal lm-eval command)
        lm = run_example("lm_eval.sh", stack_env(stack) | {"CDE_LIMIT": "2", "CDE_FAMILY": "causal",
                                                           "CDE_MODEL": "idlm-tiny"}).stdout
        assert 0.0 <= _lm_eval_acc(lm) <= 1.0 and "local-completions" in lm, lm[-2000:]
