#!/usr/bin/env bash
# The CLI client (python -m cde.client, standard library only): streams text and the top concepts
# of each chunk, and searches the concept catalog. For a Steerling model.
#   bash examples/cli.sh                  # CDE_BASE_URL, default http://127.0.0.1:8000 (the launcher's)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"   # cde.client is imported from the repo root
py="${PYTHON:-$root/.venv/bin/python}"
base="${CDE_BASE_URL:-http://127.0.0.1:8000}"
"$py" -m cde.client --url "$base" generate "Tell me about the sea" --steer sea --attribution chunks
"$py" -m cde.client --url "$base" generate "Write a poem" --suppress anger --seed 3
"$py" -m cde.client --url "$base" concepts oce
