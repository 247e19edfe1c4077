#!/usr/bin/env bash
# Opt-in: installs the torchft compatibility package (compat/, distribution
# torchtitan-ft-torchft-compat, top-level package `torchft`) editable into the current Python
# (override with PYTHON=...), so that programs written for torchft 0.2.0, and TorchTitan's own
# fault-tolerance trainer (TRAIN_FILE=torchtitan.experiments.ft.train), run on torchtitan_ft.
# scripts/install.sh never installs it. Its only dependency, torchtitan_ft, must already be
# installed (scripts/install.sh); nothing else is pulled.
#
# Refuses when the real torchft is installed: pip has no "Conflicts" metadata with which a
# distribution could refuse another, so this script checks. Uninstall with
#   pip uninstall torchtitan-ft-torchft-compat
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
# Where a distribution named torchft is installed, if one is (without importing it).
real="$("$py" -c '
import importlib.metadata as m
for d in m.distributions(name="torchft"):
    print(d.locate_file(""))
')"
if [ -n "$real" ]; then
    echo "install_torchft_compat: the real torchft is installed (at $real); the compatibility" \
        "package provides the same top-level package \`torchft\` and cannot be installed beside" \
        "it. Run \`$py -m pip uninstall torchft\` first, or keep using the real torchft." >&2
    exit 1
fi
if ! "$py" -c 'import torchtitan_ft' 2>/dev/null; then
    echo "install_torchft_compat: torchtitan_ft is not installed in $py; run scripts/install.sh first" >&2
    exit 1
fi
"$py" -m pip install --quiet --no-deps -e "$root/compat"
echo "install_torchft_compat: installed; \`import torchft\` is now torchtitan_ft" \
    "($("$py" -c 'import torchft, os; print(os.path.dirname(torchft.__file__))'))" >&2
