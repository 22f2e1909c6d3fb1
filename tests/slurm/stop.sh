#!/usr/bin/env bash
# Stop what tests/slurm/start.sh STATE_DIR started, by pid file only (never by name).
set -uo pipefail

STATE=${1:?usage: stop.sh STATE_DIR}
pids=()
for pidfile in "$STATE"/slurmd-*.pid "$STATE"/slurmctld.pid "$STATE"/munged.pid; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    rm -f "$pidfile"
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
done
for _ in $(seq 100); do  # up to 10 s for all of them, then SIGKILL
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && exit 0
    sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
exit 0
