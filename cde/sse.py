"""Reading the gateway's server-sent events, one line at a time (no dependencies).

Every client of the streamed REST API (cde/client.py, the locust user in bench/, the tests'
stream fixtures) reads the same framing: ``data: <json>`` lines, ended by ``data: [DONE]``.
"""

from __future__ import annotations

import json

DONE = "[DONE]"


def sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line, stripped; None for any other line (comments, blanks)."""
    return line[5:].strip() if line.startswith("data:") else None


def is_sse_done(line: str) -> bool:
    """Whether the line is the stream's end marker, ``data: [DONE]``."""
    return sse_data(line) == DONE


def parse_sse_line(line: str) -> dict | None:
    """The JSON of one ``data:`` line; None for other lines and for ``[DONE]`` (callers that
    must tell the end apart ask `is_sse_done`)."""
    data = sse_data(line)
    return None if data is None or data == DONE else json.loads(data)
