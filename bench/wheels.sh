#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the GPU host lacks into .whl/ (git-ignored;
# bench/run_h200.sh installs .whl/*.whl into /tmp/site at start), plus the cl100k BPE file the
# Steerling-8B tokenizer reads ($CDE_CL100K_BPE). Prints the total size: the tree sent to the
# GPU host is limited to 64 MiB in all.
#
#   bash bench/wheels.sh                 # every wheel of bench/wheels-h200.txt
#   SKIP="numpy" bash bench/wheels.sh    # leave out packages the host already has
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
pip="${PIP:-.venv/bin/pip}"
mkdir -p "$dest"
skip=" ${SKIP:-} "
grep -v '^#' bench/wheels-h200.txt | while read -r pin; do
  [ -n "$pin" ] || continue
  name="${pin%%==*}"
  case "$skip" in *" $name "*) echo "skip $pin"; continue ;; esac
  "$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d "$dest" "$pin" 2>&1 | grep -v '^WARNING: Location' || true
  ls "$dest" | grep -qi "^$(echo "${name}" | tr '.-' '__')-${pin##*==}-" || { echo "no wheel for $pin" >&2; exit 1; }
done
bpe="${CDE_CL100K_BPE:-$HOME/.cache/cde/cl100k_base.tiktoken}"
if [ -f "$bpe" ]; then cp "$bpe" "$dest/cl100k_base.tiktoken"; else echo "warning: no $bpe (set CDE_CL100K_BPE)" >&2; fi
du -ch "$dest"/* | tail -1 | sed 's/total/total in .whl\//'
mib=$(( $(du -cb "$dest"/* | tail -1 | cut -f1) / 1048576 ))
[ "$mib" -le 40 ] || echo "note: ${mib} MiB is over the ~40 MiB wheel budget (tree limit 64 MiB in all); SKIP=\"numpy\" saves 16 MiB where the host has numpy" >&2
