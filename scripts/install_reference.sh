#!/usr/bin/env bash
# Installs the reference, torchft 0.2.0, without its dependencies under .cache/ for the
# wire-compatibility tests and the side-by-side benchmarks (benchmarks/_reference.py), and
# its Python dependencies other than torch (OpenTelemetry) apart, under
# .cache/torchft_reference_deps, for benchmark workers that run torchft's own Manager.
# Idempotent. torchtitan_ft itself never imports torchft.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.cache/torchft_reference"
deps="$root/.cache/torchft_reference_deps"
py="${PYTHON:-python3}"
if ! compgen -G "$dest/torchft/_torchft*.so" >/dev/null; then
    "$py" -m pip install --quiet --no-deps --target "$dest" "torchft==0.2.0"
fi
if [ ! -d "$deps/opentelemetry/sdk" ]; then
    "$py" -m pip install --quiet --target "$deps" \
        "opentelemetry-api>=1.39.0" "opentelemetry-sdk>=1.39.0" \
        "opentelemetry-exporter-otlp-proto-http>=1.39.0"
fi
