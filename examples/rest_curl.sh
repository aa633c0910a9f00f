#!/usr/bin/env bash
# Streamed chat (SSE) with steering toward a concept and per-chunk attribution: OpenAI chunks plus
# a `cde` field with each block's attributions. For a Steerling model (the bundled steerling-small).
#   bash examples/rest_curl.sh            # CDE_BASE_URL, default http://127.0.0.1:8000 (the launcher's)
set -euo pipefail
base="${CDE_BASE_URL:-http://127.0.0.1:8000}"
curl -sSN --fail-with-body "$base/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "model": "steerling-small", "stream": true, "stream_options": {"include_usage": true},
  "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 96, "seed": 7,
  "steering": {"concepts": [{"name": "sea", "strength": 1.0}], "mode": "amplify"},
  "attribution": "chunks"}'
