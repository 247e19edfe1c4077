#!/usr/bin/env bash
# The main job on its embedded default: a local lighthouse on 127.0.0.1 (status page on
# http://127.0.0.1:29511/) and three replica groups asking it for a quorum every step; one
# is SIGKILLed mid-run and a replacement rejoins. Installs what it needs first (idempotent).
# Extra arguments go to scripts/lighthouse_demo.py (see --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
exec "${PYTHON:-python3}" scripts/lighthouse_demo.py "$@"
