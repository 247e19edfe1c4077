#!/usr/bin/env bash
# Makes the test environment of one TorchTitan release and prints its Python:
#   scripts/install_torchtitan_env.sh 0.2.2   ->  .cache/tt022/venv/bin/python
#   scripts/install_torchtitan_env.sh 0.3.0   ->  .cache/tt030/venv/bin/python
# (TORCHTITAN_ENVS=DIR puts the venvs under DIR instead of .cache). ./run_tests.sh runs the
# main suite in the 0.2.2 one and tests/titan030 in the 0.3.0 one, whatever TorchTitan the
# base Python has.
#
# The venv sees the base Python's packages (PYTHON, default python3, after scripts/install.sh:
# torch, grpcio, pytest, ...): a .pth file adds the base's site directories behind the venv's
# own. (venv's --system-site-packages would not do: made from a base that is itself a venv,
# it sees the interpreter's site-packages, not the base venv's.) The venv holds its own
# TorchTitan of that release, this checkout's torchtitan_ft (editable) and whatever those two
# need that the base lacks or has in another version (0.3.0: datasets<4.8, spmd_types, ...);
# torch stays the base's build, pinned to its exact version so that pip never fetches another.
# Idempotent: a stamp makes later runs return at once.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${PYTHON:-python3}"
version="${1:-}"
case "$version" in
    0.3.0 | 0.2.2) ;;
    *)
        echo "install_torchtitan_env: '$version' is not a supported TorchTitan release; give 0.3.0 or 0.2.2" >&2
        exit 2
        ;;
esac
venv="${TORCHTITAN_ENVS:-$root/.cache}/tt${version//./}/venv"
py="$venv/bin/python"
torch_version="$("$base" -c 'from importlib.metadata import version; print(version("torch"))')"
# The base's site directories, the ones it sees itself (a venv's, and its interpreter's where
# the venv includes them).
base_sites="$("$base" -c 'import os, site; print(repr([p for p in site.getsitepackages() if os.path.isdir(p)]))')"
requirements=("torch==$torch_version" "torchtitan==$version")
key="$( { printf '%s\n' "${requirements[@]}" "$base_sites" "$venv" "$root"; cat "$root/pyproject.toml"; } | sha256sum | cut -c1-16)"
stamp="$venv/installed-$key"
# This checkout's package, with the asked release, seen from outside the checkout.
installed() {
    (cd / && "$py" -c 'import sys, torchtitan_ft
from importlib.metadata import version
sys.exit(not torchtitan_ft.__file__.startswith(sys.argv[1] + "/") or version("torchtitan") != sys.argv[2])' "$root" "$version") 2>/dev/null
}
if [ -f "$stamp" ] && installed; then
    echo "$py"
    exit 0
fi
echo "install_torchtitan_env: TorchTitan $version into $venv (over $base, torch $torch_version)" >&2
# No pip of its own (ensurepip alone took 8 s of CPU here): the base's pip, seen through the
# .pth file below, installs into the venv it runs in.
"$base" -m venv --without-pip "$venv"
site_dir="$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "import site; list(map(site.addsitedir, $base_sites))" >"$site_dir/_torchtitan_ft_base.pth"
"$py" -m pip install --quiet "${requirements[@]}" -e "$root"
touch "$stamp"
echo "$py"
