#!/usr/bin/env bash
# Launch one torchrun job (one replica group when fault tolerance is on) of TorchTitan with the
# torchtitan_ft plugin. Same shape as TorchTitan 0.2.x's run_train.sh; every variable below is
# an optional override, and extra arguments are passed through to the trainer, e.g.
#   NGPU=2 ./run_train.sh --training.steps 20
#   ./run_train.sh --fault_tolerance.enable --fault_tolerance.replica_id=0 --fault_tolerance.group_size=2
# On CPU, NGPU is the number of processes (gloo) on this node. By default everything binds and
# connects 127.0.0.1. A replica group on another machine than its peers sets LOCAL_ADDR (this
# machine's address, torchrun's --local-addr) and --fault_tolerance.hostname to it; one that
# spans NNODES machines runs this script on each with RDZV_ENDPOINT=<node 0's address>:<port>
# and its own LOCAL_ADDR (see docs/operations.md, "Running on several machines").
# MAX_RESTARTS: how often torchrun restarts the group's workers after one fails (default 0).
# torchtitan_ft.titan.launch is torchrun, minus torchrun's traceback after a one-line config error.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NGPU=${NGPU:-"1"}
# A count torchrun would refuse with a traceback: one line instead (exit 2, as a config error).
for count in "NGPU=$NGPU" "NNODES=${NNODES:-1}"; do
    case "${count#*=}" in
        '' | *[!0-9]* | 0*)
            echo "run_train.sh: ${count} is not a count; set ${count%%=*} to a whole number >= 1" >&2
            exit 2
            ;;
    esac
done
export LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python3}
# The installed TorchTitan release decides how a config is named (torchtitan_ft/titan/releases).
release="$("$PYTHON" -m torchtitan_ft.titan.releases)" || exit $?
TRAIN_FILE=${TRAIN_FILE:-"torchtitan_ft.titan.train"}
if [ "$release" != 0.2.2 ]; then
    # TorchTitan >= 0.3.0: a config registry entry, --module M --config C (also MODULE=M
    # CONFIG=C, or MODEL=M as 0.2.x's later commands spell it), overridden by --section.key flags.
    # CONFIG_FILE=F: a TOML file over that registry config, as --job.config_file F (which
    # torchtitan_ft adds on 0.3.0; a --job.config_file among the flags comes later and wins).
    config_args=()
    module=${MODULE:-${MODEL:-}}
    if [ -n "$module" ]; then config_args+=(--module "$module"); fi
    if [ -n "${CONFIG:-}" ]; then config_args+=(--config "$CONFIG"); fi
    if [ -n "${CONFIG_FILE:-}" ]; then config_args+=(--job.config_file "$CONFIG_FILE"); fi
    # The trainer module for TRAIN_FILE (torchtitan.train: TorchTitan's own trainers), or one
    # line saying why it cannot run (0.2.x's torchtitan.experiments.ft.train: with the 0.3.0
    # form of the command) or how (a config of TorchTitan's FT trainer without a torchft).
    train_module=("$("$PYTHON" -m torchtitan_ft.titan.releases.commands "$TRAIN_FILE" "$@")") ||
        exit $?
else
    # A config by name, as TorchTitan's later launch commands spell it (MODEL or MODULE, and
    # CONFIG; see torchtitan_ft/titan/named_configs.py); CONFIG_FILE wins when both are given.
    if [ -n "${MODEL:-}${MODULE:-}${CONFIG:-}" ]; then
        if [ -n "${CONFIG_FILE:-}" ]; then
            echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE is set, so MODEL/MODULE/CONFIG are not used" >&2
        else
            CONFIG_FILE="$("$PYTHON" -m torchtitan_ft.titan.named_configs)" || exit $?
        fi
    fi
    CONFIG_FILE=${CONFIG_FILE:-"$root/configs/debug_cpu.toml"}
    config_args=(--job.config_file "$CONFIG_FILE")
    # Another trainer module (TorchTitan's torchtitan.train, or its fault-tolerance trainer
    # torchtitan.experiments.ft.train, which needs the opt-in torchft compatibility package)
    # runs through a wrapper that applies the CPU fixes first; a trainer that cannot run here
    # stops now, with one line, before torchrun starts.
    train_module=("$TRAIN_FILE")
    case "$TRAIN_FILE" in
        torchtitan_ft.*) ;;
        *)
            "$PYTHON" -m torchtitan_ft.titan.run_module --check "$TRAIN_FILE" \
                "${config_args[@]}" "$@" || exit $?
            train_module=(torchtitan_ft.titan.run_module "$TRAIN_FILE")
            ;;
    esac
fi
export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-"http://localhost:29510"}
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
# No network: datasets and tokenizers are local files.
export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

NNODES=${NNODES:-"1"}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-"${MASTER_ADDR}:0"}
MAX_RESTARTS=${MAX_RESTARTS:-"0"}
node=()
if [ -n "${LOCAL_ADDR:-}" ]; then
    node=(--local-addr "$LOCAL_ADDR")
    if [ "$NNODES" != 1 ]; then
        # torchrun guesses whether this node hosts the rendezvous from the machine's host
        # name, which fails where that name maps to loopback; LOCAL_ADDR says it.
        is_host=0
        if [ "${RDZV_ENDPOINT%:*}" = "$LOCAL_ADDR" ]; then is_host=1; fi
        node+=(--rdzv-conf "is_host=$is_host")
    fi
fi
# TorchTitan colours its step lines whatever its output is: none when this script's output is
# not a terminal (a log file, a pipe); a later --metrics.no-disable_color_printing wins.
color_args=()
if [ ! -t 1 ]; then color_args=(--metrics.disable_color_printing); fi
PYTORCH_ALLOC_CONF="expandable_segments:True" \
exec "$PYTHON" -m torchtitan_ft.titan.launch \
    --nnodes="$NNODES" --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
    --rdzv_backend c10d --rdzv_endpoint="$RDZV_ENDPOINT" ${node[@]+"${node[@]}"} \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "${train_module[@]}" ${config_args[@]+"${config_args[@]}"} ${color_args[@]+"${color_args[@]}"} "$@"
