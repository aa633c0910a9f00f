"""Finish reasons: the one mapping between the engines' names and cde.v1's FinishReason enum."""
from __future__ import annotations

from cde.rpc.v1 import common_pb2

FINISH_REASON_BY_NAME = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}
# The OpenAI-style text a REST response carries; UNSPECIFIED reads as "stop".
FINISH_REASON_TEXT = {value: name for name, value in FINISH_REASON_BY_NAME.items()}
FINISH_REASON_TEXT[common_pb2.FINISH_REASON_UNSPECIFIED] = "stop"


def finish_reason_value(name: str) -> int:
    """cde.v1 enum value for an engine's finish-reason name; a KeyError names an unknown one."""
    try:
        return FINISH_REASON_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown finish reason {name!r}; expected one of {sorted(FINISH_REASON_BY_NAME)}") from None
