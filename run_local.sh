#!/usr/bin/env bash
# The main job on its embedded default: a local lighthouse on 127.0.0.1 and two replica groups
# training TorchTitan's llama3 debug model with fault tolerance on CPU
# (configs/debug_ft_cpu.toml). Installs what it needs first (idempotent). Extra arguments go to
# scripts/local_job.py (--steps, --ngpu) and from there to the trainer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
exec "${PYTHON:-python3}" scripts/local_job.py "$@"
