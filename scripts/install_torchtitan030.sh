#!/usr/bin/env bash
# Makes the TorchTitan 0.3.0 environment beside the default one (TorchTitan 0.2.2): a venv at
# .cache/tt030/venv (override with TT030_VENV=...) that sees the base Python's packages
# (torch, grpcio, torchtitan_ft's editable install, pytest; --system-site-packages) and holds
# its own TorchTitan 0.3.0 and the dependencies 0.3.0 pins differently (datasets>=3.6,<4.8,
# spmd_types, torch_checkpointing, ...), so the base Python keeps TorchTitan 0.2.2.
# Run it after scripts/install.sh. Idempotent: a stamp makes later runs return at once.
# Then: .cache/tt030/venv/bin/python -m pytest tests/titan030, or PYTHON=.cache/tt030/venv/bin/python
# ./run_train.sh --module llama3 --config llama3_debugmodel ... (docs/titan.md).
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${PYTHON:-python3}"
venv="${TT030_VENV:-$root/.cache/tt030/venv}"
py="$venv/bin/python"
# torch stays the base Python's (CPU or CUDA, whichever scripts/install.sh installed): pinned
# here to that exact build, so that pip never replaces it with another from the registry.
torch_version="$("$base" -c 'import torch; print(torch.__version__)')"
requirements=("torch==$torch_version" "torchtitan==0.3.0" "datasets>=3.6,<4.8")
key="$( { printf '%s\n' "${requirements[@]}"; "$base" -c 'import sys; print(sys.executable)'; echo "$venv"; } | sha256sum | cut -c1-16)"
stamp="$venv/installed-$key"
installed() {
    "$py" -c 'import sys; from importlib.metadata import version
sys.exit(version("torchtitan") != "0.3.0")' 2>/dev/null
}
if [ -f "$stamp" ] && installed; then
    exit 0
fi
echo "install_torchtitan030: TorchTitan 0.3.0 into $venv (torch $torch_version from $base)" >&2
"$base" -m venv --system-site-packages "$venv"
"$py" -m pip install --quiet "${requirements[@]}"
touch "$stamp"
