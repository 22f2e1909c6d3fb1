#!/usr/bin/env bash
# Stop what tests/slurm/start.sh STATE_DIR started, by pid file only (never by name).
set -uo pipefail

STATE=${1:?usage: stop.sh STATE_DIR}
for pidfile in "$STATE"/slurmd-*.pid "$STATE"/slurmctld.pid "$STATE"/munged.pid; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || { rm -f "$pidfile"; continue; }
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    rm -f "$pidfile"
done
exit 0
