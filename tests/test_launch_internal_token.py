"""The local launcher's internal token (issue 33 item 5): ``python -m cde.launch`` generates a
random token per run by default (<run-dir>/internal_token, mode 0600, removed on exit) and gives
every service its path, so a process without it can neither register as a worker nor call an
internal service; ``--internal-token-file`` names an existing one; ``--no-internal-token`` turns
the check off. The launcher runs as a real command line here (loopback, the tiny model, bounded
waits); the flag checks and the Stack's token handling run without any service.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from cde.launch import ROOT, Stack
from cde.rpc.internal_auth import MIN_TOKEN_CHARS, TOKEN_FILE_ENV, TOKEN_MD, TokenError, load_token
from cde.rpc.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, steering_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.launcher_fixture import launch_cmd, launched
from tests.stack_fixture import MODEL, chat_body, stack_args, wait_until

REPORT_TAG = "launch"
SERVICES = ("steering", "attribution", "scheduler", "worker0", "gateway")


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _stranger(worker_id: str = "intruder") -> scheduler_pb2.WorkerInfo:
    # no free pages: even where it is accepted, nothing is placed on it
    return scheduler_pb2.WorkerInfo(worker_id=worker_id, address="127.0.0.1:9", model=MODEL,
                                    kv_pages_total=64, kv_pages_free=0)


def _stats(port: int, metadata=()) -> scheduler_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).Stats(scheduler_pb2.StatsRequest(), timeout=10,
                                                          metadata=metadata)


def _workers(stats: scheduler_pb2.StatsResponse) -> list[tuple[str, str]]:
    return sorted((w.worker_id, w.address) for w in stats.workers)


# ---- a real launcher stack: on by default, off with the flag --------------------------------------

@pytest.mark.e2e
def test_default_launcher_stack_refuses_callers_without_its_generated_token(tmp_path, report):
    with launched(tmp_path) as st:
        line = st.out.find("internal   token file ")
        assert line, f"the launcher did not say where the token is:\n{st.out.text()[-2000:]}"
        path = Path(line.split()[3])
        assert path == st.run_dir / "internal_token", (path, line)
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o600, f"token file mode {mode:o}, want 600"
        token = load_token(path)
        assert len(token) >= MIN_TOKEN_CHARS, len(token)
        envs = {name: st.environ(name).get(TOKEN_FILE_ENV) for name in SERVICES}
        assert envs == {name: str(path) for name in SERVICES}, envs

        sport, wport, steer = st.port("scheduler"), st.port("worker0"), st.port("steering")
        good, bad = ((TOKEN_MD, token),), ((TOKEN_MD, "x" * 64),)
        codes = {}
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as ch:
            sched = scheduler_pb2_grpc.SchedulerStub(ch)
            codes["register new id, no token"] = _code(lambda: sched.RegisterWorker(_stranger(), timeout=10))
            codes["register new id, wrong token"] = _code(lambda: sched.RegisterWorker(_stranger(), timeout=10,
                                                                                       metadata=bad))
            codes["heartbeat new id, no token"] = _code(lambda: sched.Heartbeat(_stranger(), timeout=10))
            codes["stats, no token"] = _code(lambda: sched.Stats(scheduler_pb2.StatsRequest(), timeout=10))
        with grpc.insecure_channel(f"127.0.0.1:{wport}") as ch:
            codes["worker info, no token"] = _code(lambda: worker_pb2_grpc.WorkerStub(ch).Info(
                worker_pb2.WorkerStatusRequest(), timeout=10))
        with grpc.insecure_channel(f"127.0.0.1:{steer}") as ch:
            codes["steering search, no token"] = _code(lambda: steering_pb2_grpc.SteeringStub(ch).SearchConcepts(
                common_pb2.SearchConceptsRequest(query="ocean", limit=3), timeout=10))
        want = {k: grpc.StatusCode.UNAUTHENTICATED for k in codes}
        assert codes == want, codes

        # the token's holders: the services among themselves (a request end to end) and us
        before = _workers(_stats(sport, good))
        assert before == [("w0", f"127.0.0.1:{wport}")], before
        r = httpx.post(f"{st.base_url}/v1/chat/completions", json=chat_body(3, 16, stream=False), timeout=120)
        assert r.status_code == 200, (r.status_code, r.text[:300])
        with grpc.insecure_channel(f"127.0.0.1:{wport}") as ch:
            info = worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.WorkerStatusRequest(), timeout=10, metadata=good)
        assert info.kv_pages_total > 0, info
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as ch:
            ack = scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(_stranger("holder"), timeout=10, metadata=good)
        assert ack.heartbeat_interval_ms > 0, ack
        after = _workers(_stats(sport, good))
        assert ("holder", "127.0.0.1:9") in after and ("intruder", "127.0.0.1:9") not in after, after
        st.proc.send_signal(signal.SIGINT)
        rc = st.proc.wait(timeout=60)
    assert rc == 0, f"launcher exit code {rc}:\n{st.out.text()[-2000:]}"
    assert not path.exists(), f"{path} left behind after the run"
    assert (st.run_dir / "scheduler.log").exists(), sorted(p.name for p in st.run_dir.iterdir())
    report(f"default launcher: token file {path.name} mode {mode:o} in every service's env; "
           + ", ".join(f"{k} -> {v.name}" for k, v in codes.items())
           + f"; with the token: Stats {before}, a request 200, registration OK; file removed on exit")


@pytest.mark.e2e
def test_no_internal_token_flag_turns_the_check_off(tmp_path, report):
    # a token file in the launcher's environment too: the flag wins, the services get none
    env_file = tmp_path / "env_token"
    env_file.write_text("e" * 40 + "\n")
    with launched(tmp_path, "--no-internal-token", env=dict(os.environ, **{TOKEN_FILE_ENV: str(env_file)})) as st:
        assert st.out.find("internal   token OFF"), st.out.text()[-2000:]
        assert st.out.find("internal   token file") is None, st.out.text()[-2000:]
        envs = {name: st.environ(name).get(TOKEN_FILE_ENV) for name in SERVICES}
        assert envs == {name: None for name in SERVICES}, envs
        assert not (st.run_dir / "internal_token").exists(), sorted(p.name for p in st.run_dir.iterdir())
        sport, wport = st.port("scheduler"), st.port("worker0")
        with grpc.insecure_channel(f"127.0.0.1:{sport}") as ch:
            code = _code(lambda: scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(_stranger(), timeout=10))
        assert code == grpc.StatusCode.OK, code
        got = _workers(_stats(sport))
        assert got == [("intruder", "127.0.0.1:9"), ("w0", f"127.0.0.1:{wport}")], got
        with grpc.insecure_channel(f"127.0.0.1:{wport}") as ch:
            info = worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.WorkerStatusRequest(), timeout=10)
        assert info.kv_pages_total > 0, info
    report(f"--no-internal-token: no {TOKEN_FILE_ENV} in any service (even with it set for the launcher); "
           f"a registration without a token accepted: {got}")


# ---- the flags and the Stack's token handling, no services -----------------------------------------

def _run_cli(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(launch_cmd(tmp_path / "run", *flags, timeout=5), cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_a_bad_token_file_stops_the_launcher_before_it_starts_anything(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    for flags, want in ((["--internal-token-file", str(tmp_path / "missing")], "cannot read"),
                        (["--internal-token-file", str(short)], f"at least {MIN_TOKEN_CHARS}")):
        p = _run_cli(tmp_path, *flags)
        out = p.stdout + p.stderr
        assert p.returncode == 1 and want in out, (flags, p.returncode, out[-2000:])
        assert " pid " not in out and "redis " not in out, (flags, out[-2000:])
    both = _run_cli(tmp_path, "--internal-token-file", str(short), "--no-internal-token")
    assert both.returncode == 2 and "not allowed with" in both.stderr, (both.returncode, both.stderr[-1000:])
    helps = subprocess.run([sys.executable, "-m", "cde.launch", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert "--no-internal-token" in helps.stdout and "--internal-token-file" in helps.stdout, helps.stdout[-2000:]


def test_stack_generates_a_fresh_private_token_per_run(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "internal_token").write_text("old\n")
    (run_dir / "internal_token").chmod(0o644)   # a stale wider file is replaced, never reused
    tokens = []
    for _ in range(2):
        stack = Stack(stack_args(run_dir))
        stack.prepare_internal_token()
        path = stack.internal_token_file
        assert path == run_dir / "internal_token", path
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o600, f"mode {mode:o}"
        assert load_token(path) == stack.internal_token, (path.read_text(), stack.internal_token)
        assert stack.service_env()[TOKEN_FILE_ENV] == str(path), stack.service_env().get(TOKEN_FILE_ENV)
        assert stack.internal_metadata == ((TOKEN_MD, stack.internal_token),), stack.internal_metadata
        tokens.append(stack.internal_token)
        stack.stop()
        assert not path.exists() and run_dir.exists(), (path.exists(), run_dir.exists())
    assert tokens[0] != tokens[1], tokens


def test_stack_uses_a_named_token_file_or_none(tmp_path, monkeypatch):
    named = tmp_path / "mine"
    named.write_text("n" * 48 + "\n")
    named.chmod(0o600)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    stack = Stack(stack_args(tmp_path / "a", internal_token_file=named))
    stack.prepare_internal_token()
    assert (stack.internal_token, stack.internal_token_file) == ("n" * 48, named.resolve()), \
        (stack.internal_token, stack.internal_token_file)
    assert stack.service_env()[TOKEN_FILE_ENV] == str(named.resolve()), stack.service_env().get(TOKEN_FILE_ENV)
    stack.stop()
    assert named.exists(), "the launcher removed a token file it did not make"

    monkeypatch.setenv(TOKEN_FILE_ENV, str(named))   # the launcher's own environment names one
    stack = Stack(stack_args(tmp_path / "b"))
    stack.prepare_internal_token()
    assert stack.internal_token_file == named.resolve() and not (tmp_path / "b" / "internal_token").exists(), \
        stack.internal_token_file

    off = Stack(stack_args(tmp_path / "c", internal_token=False))
    off.prepare_internal_token()
    assert (off.internal_token, off.internal_token_file, off.internal_metadata) == (None, None, ()), \
        (off.internal_token, off.internal_token_file)
    assert TOKEN_FILE_ENV not in off.service_env(), off.service_env().get(TOKEN_FILE_ENV)

    bad = Stack(stack_args(tmp_path / "d", internal_token_file=tmp_path / "nope"))
    with pytest.raises(TokenError, match="cannot read"):
        bad.prepare_internal_token()
