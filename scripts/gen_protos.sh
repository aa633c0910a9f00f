#!/usr/bin/env bash
# Generate the Python stubs for protos/cde/v1/*.proto into cde/rpc/v1/ (committed).
#
#   bash scripts/gen_protos.sh                  # rewrite cde/rpc/v1/ from the .proto files
#   bash scripts/gen_protos.sh --out DIR        # write DIR/cde/rpc/v1/ instead (the contract test)
#   bash scripts/gen_protos.sh --update-golden  # also refresh protos/golden/cde_v1.binpb, after
#                                               # checking the change is compatible with it
#
# Layout. The .proto files keep their canonical names (cde/v1/x.proto, package cde.v1):
# that is what reflection, the golden descriptor set and other languages see. protoc writes
# Python modules for them as `cde.v1.x_pb2`; we move them to cde/rpc/v1/ and rewrite the
# two places that name the module (`from cde.v1 import` and the builder's module name), so
# `from cde.rpc.v1 import generate_pb2, generate_pb2_grpc` works with no sys.path tricks.
#
# Version choice: grpcio-tools==1.64.3 (bundled protoc = protobuf 5.26.1), pinned in
# requirements-test.txt, because its output has no hard version gate. Measured with the
# worker/attribution stubs served and called over grpc.aio (upb and pure-python protobuf):
#   grpcio-tools   *_pb2.py imports under          *_pb2_grpc.py works with
#   1.62.3         protobuf 4.25 .. 7.36           grpcio >= 1.62  (but needs protobuf < 5 to install)
#   1.64.3 (used)  protobuf 4.25 .. 7.36           grpcio >= 1.64.0 (RuntimeWarning below 1.64.3;
#                                                  1.62/1.63 lack add_registered_method_handlers)
#   1.66 .. 1.71   protobuf >= 5.27/5.29 (runtime  grpcio >= generator version (RuntimeError)
#                  check, ImportError before)
#   >= 1.72        protobuf >= 6.30 (VersionError) grpcio >= generator version (RuntimeError)
# So the committed stubs run on any protobuf from 4.25 through 7.x and any grpcio >= 1.64,
# whatever the GPU image brings. 1.62.3 would reach grpcio 1.62 but cannot be installed next to
# protobuf 5 (it pins protobuf < 5), and patching generated code is worse than a 1.64 floor.
# The output is deterministic: rerunning gives byte-identical files (tests/test_contracts.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
out_root="$root"
update_golden=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out_root="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    --update-golden) update_golden=1; shift ;;
    *) echo "usage: $0 [--out DIR] [--update-golden]" >&2; exit 2 ;;
  esac
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$root/protos"
mapfile -t protos < <(find cde/v1 -name '*.proto' | LC_ALL=C sort)
"$python" -m grpc_tools.protoc -I. \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  --descriptor_set_out="$tmp/cde_v1.binpb" --include_imports \
  "${protos[@]}"

golden="$root/protos/golden/cde_v1.binpb"
if [ "$update_golden" = 1 ] && [ -f "$golden" ]; then
  # refuse before touching anything when the change breaks the current golden
  (cd "$root" && "$python" -m cde.rpc.compat "$golden" "$tmp/cde_v1.binpb")
fi

dest="$out_root/cde/rpc/v1"
mkdir -p "$dest"
rm -f "$dest"/*_pb2.py "$dest"/*_pb2.pyi "$dest"/*_pb2_grpc.py
for f in "$tmp"/cde/v1/*.py "$tmp"/cde/v1/*.pyi; do
  name="$(basename "$f")"
  # a *_pb2_grpc.py for a file without services holds nothing
  if [[ "$name" == *_pb2_grpc.py ]] && ! grep -q '^class ' "$f"; then continue; fi
  sed -e 's/^from cde\.v1 import /from cde.rpc.v1 import /' \
      -e "s/'cde\.v1\.\([a-z_]*_pb2\)'/'cde.rpc.v1.\1'/" "$f" > "$dest/$name"
done
printf '%s\n' '"""Generated from protos/cde/v1 by scripts/gen_protos.sh. Do not edit."""' > "$dest/__init__.py"

if [ "$update_golden" = 1 ]; then
  mkdir -p "$(dirname "$golden")"
  cp "$tmp/cde_v1.binpb" "$golden"
  echo "updated $golden"
fi
