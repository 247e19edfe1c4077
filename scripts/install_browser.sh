#!/usr/bin/env bash
# Installs Debian's chromium for the status-page browser test (tests/lighthouse/test_dashboard.py).
# Idempotent; needs root (apt-get). Without it the browser test is skipped and says why.
set -euo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: not root or no apt-get; the browser test will be skipped" >&2
    exit 0
fi
echo "install_browser: installing chromium (Debian package)" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
