"""The CLI client (python -m cde.client) as a user runs it: piped into a reader that stops early
(`... | head`), it exits quietly, without a BrokenPipeError traceback. The server is a stand-in
(standard library HTTP server answering the three routes the CLI calls), so no stack is needed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cde.launch import ROOT

N = 20_000   # lines of output: far more than a pipe buffer holds


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            data = {"object": "list", "data": [{"id": "stand-in", "cde": {"family": "steerling"}}]}
        else:   # /v1/concepts?q=...
            data = {"object": "list", "data": [{"id": i, "head": "known", "name": f"concept {i}",
                                                "group_name": "g"} for i in range(N)]}
        self._send(json.dumps(data).encode(), "application/json")

    def do_POST(self) -> None:   # /v1/chat/completions, streamed: one short line of text per event
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        events = [{"choices": [{"index": 0, "delta": {"content": f"line {i}\n"}}]} for i in range(N)]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(body.encode(), "text/event-stream")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("args", [["concepts", "oce", "--limit", str(N)],
                                  ["generate", "Tell me about the sea", "--attribution", "none"]])
def test_cli_piped_into_a_reader_that_stops_early_exits_quietly(server, args) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "cde.client", "--url", server, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()   # `| head -1`: read one line, then go away
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert first.strip(), "the CLI printed nothing"
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode(errors="replace")
    assert err == b"", err.decode(errors="replace")
    assert proc.returncode == 141   # what a shell reports for a program ended by SIGPIPE (128 + 13)


def test_cli_output_in_full_when_nobody_stops_reading(server) -> None:
    proc = subprocess.run([sys.executable, "-m", "cde.client", "--url", server, "concepts", "oce", "--limit", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert len(proc.stdout.splitlines()) == N   # the stand-in ignores the limit
