#!/usr/bin/env bash
# A causal (I-DLM) model with introspective strided decoding (decode.stride), not streamed.
# Start its stack first: .venv/bin/python -m cde.launch --model-dir models/idlm-tiny
#   bash examples/rest_causal_curl.sh     # CDE_BASE_URL, default http://127.0.0.1:8000 (the launcher's)
set -euo pipefail
base="${CDE_BASE_URL:-http://127.0.0.1:8000}"
curl -sS --fail-with-body "$base/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64,
  "temperature": 0.7, "top_p": 0.95, "seed": 1, "decode": {"stride": 4}}'
echo
