#!/usr/bin/env bash
# Installs torchtitan_ft (editable) and everything it needs into the current Python
# (override with PYTHON=...). Idempotent: once the dependency list is installed for this
# checkout, a stamp makes later runs return at once.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
stamp_dir="$root/.cache"
key="$( { cat "$root/pyproject.toml"; "$py" -c 'import sys; print(sys.executable)'; echo "$root"; } | sha256sum | cut -c1-16)"
stamp="$stamp_dir/install-$key"
# The check runs outside the checkout (where the checkout itself would be importable) and wants
# this checkout's package: an editable install of another clone must be redone.
installed_here() {
    (cd / && "$py" -c 'import sys, torch, torchtitan, grpc, torchtitan_ft
sys.exit(not torchtitan_ft.__file__.startswith(sys.argv[1] + "/"))' "$root") 2>/dev/null
}
if [ -f "$stamp" ] && installed_here; then
    exit 0
fi
echo "install: installing torchtitan_ft and its dependencies into $("$py" -c 'import sys; print(sys.prefix)')" >&2
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build from the registry.
"$py" -m pip install --quiet "torch==2.13.0"
"$py" -m pip install --quiet -e "$root[dev,demo]"
mkdir -p "$stamp_dir"
touch "$stamp"
