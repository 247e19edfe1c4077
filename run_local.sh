#!/usr/bin/env bash
# The main job on its embedded default: a local lighthouse on 127.0.0.1 and two replica groups
# training TorchTitan's llama3 debug model with fault tolerance on CPU. Installs what it needs
# first into the current Python (PYTHON=... names another; idempotent): scripts/install.sh,
# with TorchTitan 0.3.0 (--module llama3 --config llama3_debugmodel in a small CPU shape), or
# 0.2.2 with TORCHTITAN_VERSION=0.2.2 (configs/debug_ft_cpu.toml); either replaces the other
# there. Extra arguments go to scripts/local_job.py (--steps, --ngpu) and from there to the
# trainer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
exec "${PYTHON:-python3}" scripts/local_job.py "$@"
