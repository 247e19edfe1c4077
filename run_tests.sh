#!/usr/bin/env bash
# Runs the test suite. Installs what it needs first (idempotent, quick once installed):
# torchtitan_ft with its dependencies, the torchft 0.2.0 reference for the wire-compatibility
# tests, Debian's chromium for the status-page browser test, and the TorchTitan 0.3.0
# environment (.cache/tt030/venv) beside the default one (TorchTitan 0.2.2).
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/lighthouse
# Without test paths, the TorchTitan 0.3.0 tests (tests/titan030) then run in the 0.3.0
# environment with the same options (in the default environment they are skipped).
# Two pytest-xdist workers on a machine with 2 or more cores (TEST_WORKERS=N sets the number,
# 0 runs in one process): the TorchTitan and multi-host tests run on one worker, one after the
# other (tests/conftest.py), the rest on the other one beside them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
bash scripts/install_reference.sh
bash scripts/install_browser.sh
bash scripts/install_torchtitan030.sh
workers=${TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
paths=0
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then paths=1; fi ;;
    esac
done
status=0
"${PYTHON:-python3}" -m pytest -n "$workers" --dist loadgroup "$@" || status=$?
if [ "$paths" = 0 ]; then
    echo "run_tests.sh: the TorchTitan 0.3.0 tests, in .cache/tt030/venv" >&2
    .cache/tt030/venv/bin/python -m pytest -n 0 "$@" tests/titan030 || status=$?
fi
exit "$status"
