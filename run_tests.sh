#!/usr/bin/env bash
# Runs the test suite. Installs what it needs first (idempotent, quick once installed):
# torchtitan_ft with its dependencies, the torchft 0.2.0 reference for the wire-compatibility
# tests, and Debian's chromium for the status-page browser test.
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/lighthouse
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
bash scripts/install_reference.sh
bash scripts/install_browser.sh
exec "${PYTHON:-python3}" -m pytest "$@"
