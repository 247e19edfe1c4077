#!/usr/bin/env bash
# Installs torchtitan_ft (editable) and everything it needs into the current Python
# (override with PYTHON=...), with one TorchTitan release: TORCHTITAN_VERSION=0.3.0 (the
# default) or 0.2.2, and the dependencies that release needs (0.3.0 pins datasets>=3.6,<4.8,
# spmd_types, ...; pyproject.toml's ranges accept both releases). Installing the other release
# later replaces it. Idempotent: once this checkout, release and dependency list are installed,
# a stamp makes later runs return at once.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
version="${TORCHTITAN_VERSION:-0.3.0}"
# The supported releases (torchtitan_ft.titan.releases.Release; tests/test_install.py keeps
# the two lists equal).
case "$version" in
    0.3.0 | 0.2.2) ;;
    *)
        echo "install: TORCHTITAN_VERSION=$version is not a supported TorchTitan release; set it to 0.3.0 (the default) or 0.2.2" >&2
        exit 2
        ;;
esac
stamp_dir="$root/.cache"
key="$( { cat "$root/pyproject.toml"; "$py" -c 'import sys; print(sys.executable)'; echo "$root"; echo "torchtitan==$version"; } | sha256sum | cut -c1-16)"
stamp="$stamp_dir/install-$key"
# The check runs outside the checkout (where the checkout itself would be importable) and wants
# this checkout's package with the asked release: an editable install of another clone, or
# another TorchTitan, must be redone.
installed_here() {
    (cd / && "$py" -c 'import sys, torch, torchtitan, grpc, torchtitan_ft
from importlib.metadata import version
sys.exit(not torchtitan_ft.__file__.startswith(sys.argv[1] + "/") or version("torchtitan") != sys.argv[2])' "$root" "$version") 2>/dev/null
}
if [ -f "$stamp" ] && installed_here; then
    exit 0
fi
echo "install: installing torchtitan_ft with TorchTitan $version and their dependencies into $("$py" -c 'import sys; print(sys.prefix)')" >&2
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build from the registry.
# 2.13.0, the oldest supported release, as a CPU build (about 180 MB; the 2.14.1 and 2.15.0
# wheels are CUDA builds of over 5 GB installed): the default tier runs on it (README,
# "Tested versions").
"$py" -m pip install --quiet "torch==2.13.0"
"$py" -m pip install --quiet -e "$root[dev,demo]" "torchtitan==$version"
mkdir -p "$stamp_dir"
touch "$stamp"
