#!/usr/bin/env bash
# Input attribution: generate, then ask which prompt tokens and earlier generated tokens made the
# model commit the first generated token (integrated gradients on the diffusion replay; a Steerling
# model, the bundled steerling-small). Prints the attribution JSON.
#   bash examples/input_attribution.sh    # CDE_BASE_URL, default http://127.0.0.1:8000 (the launcher's)
set -euo pipefail
base="${CDE_BASE_URL:-http://127.0.0.1:8000}"
py="${PYTHON:-python3}"
out="$(curl -sS --fail-with-body "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "steerling-small", "prompt": "The sea is", "max_tokens": 16, "seed": 7}')"
id="$(printf '%s' "$out" | "$py" -c 'import json, sys; print(json.load(sys.stdin)["id"])')"
first="$(printf '%s' "$out" | "$py" -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')"
curl -sS --fail-with-body "$base/v1/attributions/inputs" -H 'Content-Type: application/json' \
  -d "{\"request_id\": \"$id\", \"positions\": [$first], \"n_steps\": 32}"
