#!/usr/bin/env bash
# Makes the Ray Train environment of the Ray launcher's test (tests/launchers/test_ray.py, the
# --full tier) and prints its Python: .cache/ray/venv/bin/python, with ray[train] 2.60.0 (the
# first release with Ray Train's torchft backend, TorchftConfig) over the base Python's
# packages (PYTHON, default python3: torch, grpcio, ... and torchtitan_ft's dependencies), as
# scripts/install_torchtitan_env.sh makes the TorchTitan venvs: a .pth file adds the base's
# site directories behind the venv's own, the base's pip installs into it, torch stays the
# base's build. The test puts this checkout and its torchft compatibility package (compat/)
# on PYTHONPATH; neither is installed here. ./run_tests.sh --full runs this; the default run
# does not (Ray is about 270 MB and a minute to install, and its cluster takes 20-60 s to
# start on a loaded 2-core machine). Idempotent: a stamp makes later runs return at once.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${PYTHON:-python3}"
venv="$root/.cache/ray/venv"
py="$venv/bin/python"
torch_version="$("$base" -c 'from importlib.metadata import version; print(version("torch"))')"
base_sites="$("$base" -c 'import os, site; print(repr([p for p in site.getsitepackages() if os.path.isdir(p)]))')"
requirements=("torch==$torch_version" "ray[train]==2.60.0")
key="$( { printf '%s\n' "${requirements[@]}" "$base_sites" "$venv"; } | sha256sum | cut -c1-16)"
stamp="$venv/installed-$key"
if [ -f "$stamp" ] && "$py" -c 'import ray.train.v2.torch.torchft_config' 2>/dev/null; then
    echo "$py"
    exit 0
fi
echo "install_ray: ray[train] 2.60.0 into $venv (over $base, torch $torch_version)" >&2
"$base" -m venv --without-pip "$venv"
site_dir="$("$py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "import site; list(map(site.addsitedir, $base_sites))" >"$site_dir/_torchtitan_ft_base.pth"
"$py" -m pip install --quiet "${requirements[@]}"
touch "$stamp"
echo "$py"
