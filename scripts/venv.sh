#!/usr/bin/env bash
# Create or reuse .venv at the repo root and install the pinned requirements.
# Usage: source-free; `bash scripts/venv.sh [requirements-file]`. Idempotent and quiet when up to date.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
req="${1:-requirements.txt}"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.installed-$(basename "$req")-$(cat requirements*.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  # pip is quiet (-q): say what it is doing, since the first run takes a minute or two
  count="$(cat "$req" $(sed -n 's/^-r[[:space:]]*//p' "$req") | grep -cvE '^[[:space:]]*(#|-r|$)')"
  echo "installing $count packages from $req into .venv (first run or changed requirements, ~1-2 min)..." >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -r "$req"
  if [ "$req" = "requirements-test.txt" ]; then
    # The oracle (Guide Labs' public steerling package) declares Python>=3.13 and old pins;
    # its model code runs on 3.11 and current torch (docs/STEERLING.md).
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python steerling==0.2.0
  fi
  touch "$stamp"
  echo "installed $req into .venv" >&2
fi
