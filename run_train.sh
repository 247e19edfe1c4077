#!/usr/bin/env bash
# Launch one torchrun job (one replica group when fault tolerance is on) of TorchTitan with the
# torchtitan_ft plugin. Same shape as TorchTitan 0.2.x's run_train.sh; every variable below is
# an optional override, and extra arguments are passed through to the trainer, e.g.
#   NGPU=2 ./run_train.sh --training.steps 20
#   ./run_train.sh --fault_tolerance.enable --fault_tolerance.replica_id=0 --fault_tolerance.group_size=2
# On CPU, NGPU is the number of processes (gloo). Everything binds/connects 127.0.0.1.
# torchtitan_ft.titan.launch is torchrun, minus torchrun's traceback after a one-line config error.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU=${NGPU:-"1"}
export LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python3}
# A config by name, as TorchTitan's later launch commands spell it (MODEL or MODULE, and CONFIG;
# see torchtitan_ft/titan/named_configs.py); CONFIG_FILE wins when both are given.
if [ -n "${MODEL:-}${MODULE:-}${CONFIG:-}" ]; then
    if [ -n "${CONFIG_FILE:-}" ]; then
        echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE is set, so MODEL/MODULE/CONFIG are not used" >&2
    else
        CONFIG_FILE="$("$PYTHON" -m torchtitan_ft.titan.named_configs)" || exit $?
    fi
fi
CONFIG_FILE=${CONFIG_FILE:-"$root/configs/debug_cpu.toml"}
TRAIN_FILE=${TRAIN_FILE:-"torchtitan_ft.titan.train"}
export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-"http://localhost:29510"}
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
# No network: datasets and tokenizers are local files.
export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

PYTORCH_ALLOC_CONF="expandable_segments:True" \
exec "$PYTHON" -m torchtitan_ft.titan.launch \
    --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="${MASTER_ADDR}:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
