"""``python -m cde.launch`` as a real command line for tests (loopback, the tiny model by
default, bounded waits): started until "ready", stopped with Ctrl-C on the way out; its
services' pids, argv, ports and environment read from its output and /proc.

    with launched(tmp_path, "--ha") as st:
        st.pid("gateway"), st.base_url, st.out.find("restarted")
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cde.launch import ROOT, TINY_MODEL
from cde.redis_util import free_ports
from tests.stack_fixture import LauncherOutput, wait_until


@dataclass
class Launched:
    proc: subprocess.Popen
    out: LauncherOutput
    run_dir: Path
    base_url: str

    def pid(self, name: str) -> int:
        """The service's pid now: its start line's, or its latest restart's."""
        heads = (f"{name:<10} pid ", f"{name:<10} restarted, pid ")
        lines = [line for line in list(self.out.lines) if line.startswith(heads)]
        assert lines, f"no pid line for {name}: {self.out.text()[-2000:]}"
        return int(lines[-1].rsplit("pid ", 1)[1].split()[0])

    def argv(self, name: str) -> list[str]:
        return Path(f"/proc/{self.pid(name)}/cmdline").read_bytes().decode().split("\0")

    def port(self, name: str) -> int:
        argv = self.argv(name)
        return int(argv[argv.index("--port") + 1])

    def environ(self, name: str) -> dict[str, str]:
        raw = Path(f"/proc/{self.pid(name)}/environ").read_bytes().decode(errors="replace")
        return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def launch_cmd(run_dir: Path, *flags: str, timeout: float = 240) -> list[str]:
    http_port, grpc_port = free_ports(2)
    return [sys.executable, "-m", "cde.launch", "--model-dir", str(TINY_MODEL), "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--run-dir", str(run_dir), "--timeout", f"{timeout:g}", *flags]


@contextlib.contextmanager
def launched(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Launched]:
    """``python -m cde.launch`` with ``flags``, until ready; Ctrl-C (SIGINT) on the way out."""
    run_dir = tmp_path / "run"
    cmd = launch_cmd(run_dir, *flags)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = LauncherOutput(proc)
    http_port = cmd[cmd.index("--http-port") + 1]
    try:
        wait_until(lambda: out.find("ready: REST") or proc.poll() is not None, 300, 0.2, "launcher ready")
        assert proc.poll() is None, f"launcher exited with {proc.returncode}:\n{out.text()[-3000:]}"
        yield Launched(proc, out, run_dir, f"http://127.0.0.1:{http_port}")
    except BaseException:
        print(out.text()[-4000:])
        raise
    finally:
        stop_launcher(proc)


def stop_launcher(proc: subprocess.Popen) -> None:
    """Ctrl-C (SIGINT): the launcher stops every service it started; its process group is
    killed if it has not within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # the launcher this test started, its own group
            proc.wait(timeout=10)
