#!/usr/bin/env bash
# Regenerates the Python stubs of torchtitan_ft/proto/torchft.proto (grpcio-tools, pinned in
# pyproject.toml's dev extra). tests/test_proto.py fails when the committed stubs are stale.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
cd "$root"
"${PYTHON:-python3}" -m grpc_tools.protoc -I . --python_out="$out" --grpc_python_out="$out" \
    --pyi_out="$out" torchtitan_ft/proto/torchft.proto
