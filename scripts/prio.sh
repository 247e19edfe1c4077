#!/usr/bin/env bash
# Runs a measured command in a CPU cgroup of the highest weight, capped at PRIO_CPUS CPUs
# (default 1.8), so that other processes on a shared machine neither slow it down nor are
# starved completely by it. Its children inherit the cgroup (and cgroups that
# torchtitan_ft.testing.cpulimit makes under it share its cap). Needs root and a cgroup file
# system with the cpu controller (v1 cpu.shares / cpu.cfs_quota_us, or v2 cpu.weight / cpu.max).
# Usage: scripts/prio.sh COMMAND [ARGS...]
#   e.g. scripts/prio.sh python -m benchmarks.goodput --duration 180
set -euo pipefail
if [ $# = 0 ]; then
    echo "usage: scripts/prio.sh COMMAND [ARGS...]" >&2
    exit 2
fi
cpus="${PRIO_CPUS:-1.8}"
period=100000
quota="$(python3 -c "import sys; c = float(sys.argv[1]); assert c > 0; print(int(c * $period))" "$cpus" 2>/dev/null)" || {
    echo "prio.sh: PRIO_CPUS=$cpus is not a number of CPUs > 0" >&2
    exit 2
}
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    cg=/sys/fs/cgroup/torchtitan_ft_prio
    mkdir -p "$cg"
    echo 10000 > "$cg/cpu.weight"
    echo "$quota $period" > "$cg/cpu.max"
else
    cg=/sys/fs/cgroup/cpu/torchtitan_ft_prio
    mkdir -p "$cg"
    echo 262144 > "$cg/cpu.shares"
    echo "$period" > "$cg/cpu.cfs_period_us"
    echo "$quota" > "$cg/cpu.cfs_quota_us"
fi
echo $$ > "$cg/cgroup.procs"
exec "$@"
