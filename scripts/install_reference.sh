#!/usr/bin/env bash
# Installs the reference, torchft 0.2.0, without its dependencies under .cache/ for the
# wire-compatibility tests and the side-by-side benchmarks (benchmarks/_reference.py).
# Idempotent. torchtitan_ft itself never imports torchft.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.cache/torchft_reference"
if compgen -G "$dest/torchft/_torchft*.so" >/dev/null; then
    exit 0
fi
"${PYTHON:-python3}" -m pip install --quiet --no-deps --target "$dest" "torchft==0.2.0"
