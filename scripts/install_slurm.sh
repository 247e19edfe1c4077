#!/usr/bin/env bash
# Installs Debian's Slurm (slurm-wlm: slurmctld, slurmd and the client commands; 22.05 on
# Debian 12) and munge for the Slurm launcher's tests (tests/launchers/test_slurm.py), which
# start their own daemons under a temporary folder (torchtitan_ft/testing/slurm_cluster.py); no
# service of the packages is used. Idempotent; needs root (apt-get). Without it the tests that
# need Slurm are skipped and say why.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"
if command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 \
    && command -v munged >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: not root or no apt-get; the Slurm tests will be skipped" >&2
    exit 0
fi
echo "install_slurm: installing slurm-wlm and munge (Debian packages)" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge \
    >/dev/null
