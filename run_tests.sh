#!/usr/bin/env bash
# Runs the test suite. Installs what it needs first (idempotent, quick once installed):
# torchtitan_ft with its dependencies, the torchft 0.2.0 reference for the wire-compatibility
# tests, and Debian's chromium for the status-page browser test.
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/lighthouse
# Two pytest-xdist workers on a machine with 2 or more cores (TEST_WORKERS=N sets the number,
# 0 runs in one process): the TorchTitan and multi-host tests run on one worker, one after the
# other (tests/conftest.py), the rest on the other one beside them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
bash scripts/install_reference.sh
bash scripts/install_browser.sh
workers=${TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
exec "${PYTHON:-python3}" -m pytest -n "$workers" --dist loadgroup "$@"
