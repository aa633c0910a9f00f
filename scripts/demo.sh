#!/usr/bin/env bash
# Install everything into .venv (created if missing) and run a demo request on the bundled tiny model.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/venv.sh requirements.txt
exec .venv/bin/python -m cde.steerling.demo "${@:-Tell me about the sea}" --steer ocean
