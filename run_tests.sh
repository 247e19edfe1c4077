#!/usr/bin/env bash
# Runs the test suite on both TorchTitan releases. Installs what it needs first (idempotent,
# quick once installed): torchtitan_ft with its dependencies into the base Python (PYTHON,
# default python3; scripts/install.sh), the torchft 0.2.0 reference for the wire-compatibility
# tests, Debian's chromium for the status-page browser test, Debian's Slurm and munge for the
# Slurm launcher's tests (scripts/install_slurm.sh), with --full Ray Train for the Ray
# launcher's test (scripts/install_ray.sh: .cache/ray/venv), and one venv per TorchTitan
# release over the base (scripts/install_torchtitan_env.sh: .cache/tt022/venv and
# .cache/tt030/venv). The main suite runs in the 0.2.2 venv, tests/titan030 in the 0.3.0 one,
# each with the venv's bin first on PATH and PYTHON set to its Python, so that the processes the
# tests start (python3, run_train.sh, torchrun) train on that release too; the base's own
# TorchTitan is not used (the base keeps the supported release it has; a fresh one gets
# install.sh's default).
# Extra arguments go to pytest, e.g. ./run_tests.sh tests/lighthouse; test paths (paths that
# exist in this checkout) under tests/titan030 run in the 0.3.0 venv, the others in the 0.2.2
# one. Without test paths, the
# main suite runs, then tests/titan030 with the same options.
# Two pytest-xdist workers on a machine with 2 or more cores (TEST_WORKERS=N sets the number,
# 0 runs in one process): the TorchTitan and multi-host tests run on one worker, one after the
# other (tests/conftest.py), the rest on the other one beside them. tests/titan030 runs in one
# process (its tests are TorchTitan jobs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
here="$(pwd -P)"
base="${PYTHON:-python3}"
if [ -z "${TORCHTITAN_VERSION:-}" ]; then
    # python -m imports this checkout's torchtitan_ft (no torch, no TorchTitan); it prints the
    # installed release, or fails where none or another one is installed.
    if current="$("$base" -m torchtitan_ft.titan.releases 2>/dev/null)"; then
        export TORCHTITAN_VERSION="$current"
    fi
fi
PYTHON="$base" bash scripts/install.sh
PYTHON="$base" bash scripts/install_reference.sh
bash scripts/install_browser.sh
bash scripts/install_slurm.sh
# Ray Train for the Ray launcher's test, only for the full tier (about 270 MB).
for arg in "$@"; do
    if [ "$arg" = "--full" ]; then
        PYTHON="$base" bash scripts/install_ray.sh >/dev/null
        break
    fi
done
py022="$(PYTHON="$base" bash scripts/install_torchtitan_env.sh 0.2.2)"
py030="$(PYTHON="$base" bash scripts/install_torchtitan_env.sh 0.3.0)"

# Runs pytest in the venv of the Python $1 with the remaining arguments.
pytest_in() {
    local py="$1"
    shift
    local bin
    bin="$(dirname "$py")"
    PATH="$bin:$PATH" VIRTUAL_ENV="$(dirname "$bin")" PYTHON="$py" "$py" -m pytest "$@"
}

workers=${TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
options=()
main_paths=()
titan030_paths=()
for arg in "$@"; do
    case "$arg" in
        -*) options+=("$arg") ;;
        *)
            # A test path: one that exists in this checkout; anything else is an option's value.
            where="$(realpath -m "${arg%%::*}")/"
            if [ ! -e "${arg%%::*}" ] || [ "${where#"$here/"}" = "$where" ]; then
                options+=("$arg")
            elif [ "${where#"$here/tests/titan030/"}" != "$where" ]; then
                titan030_paths+=("$arg")
            else
                main_paths+=("$arg")
            fi
            ;;
    esac
done
status=0
if [ $((${#main_paths[@]} + ${#titan030_paths[@]})) = 0 ]; then
    pytest_in "$py022" -n "$workers" --dist loadgroup ${options[@]+"${options[@]}"} || status=$?
    echo "run_tests.sh: the TorchTitan 0.3.0 tests, in $(dirname "$(dirname "$py030")")" >&2
    pytest_in "$py030" -n 0 ${options[@]+"${options[@]}"} tests/titan030 || status=$?
else
    if [ ${#main_paths[@]} != 0 ]; then
        pytest_in "$py022" -n "$workers" --dist loadgroup ${options[@]+"${options[@]}"} \
            "${main_paths[@]}" || status=$?
    fi
    if [ ${#titan030_paths[@]} != 0 ]; then
        pytest_in "$py030" -n 0 ${options[@]+"${options[@]}"} "${titan030_paths[@]}" || status=$?
    fi
fi
exit "$status"
