"""Which model family a checkpoint directory holds, from its config.json (no torch).

* "steerling": block-causal diffusion with a concept bottleneck (`model_type` "steerling",
  the published Steerling-8B directory, or "causal_diffusion", the public package's
  converter layout): block decoding, attribution, steering.
* "causal": a Qwen3 / SDAR-layout causal LM (`model_type` "qwen3" or "sdar", I-DLM):
  autoregressive or introspective strided decoding (`decode.stride`), no concepts.
"""

from __future__ import annotations

import json
from pathlib import Path

STEERLING = "steerling"
CAUSAL = "causal"
_BY_MODEL_TYPE = {"steerling": STEERLING, "causal_diffusion": STEERLING, "qwen3": CAUSAL, "sdar": CAUSAL}


def model_family(model_dir: str | Path) -> str:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path}")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ValueError(f"{path}: model_type {model_type!r} is not served here "
                         f"(known: {', '.join(sorted(_BY_MODEL_TYPE))})") from None
