#!/usr/bin/env bash
# Install everything into .venv (created if missing), start the local stack (embedded Redis +
# steering, attribution, scheduler, worker, gateway; tiny model on the CPU), send one demo
# request, and keep serving until Ctrl-C. Extra arguments go to `python -m cde.launch`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/venv.sh requirements.txt
exec .venv/bin/python -m cde.launch --demo "$@"
