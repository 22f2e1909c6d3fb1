#!/usr/bin/env bash
# Issue #49's peer campaign (bench/peer_parity.py), resumed session after session at the code its kept runs were made
# with, while development goes on beside it on main.
#
#   bench/campaign.sh start [ARGS]  # this checkout detached at PIN and set up; main checked out in $DEV (its own
#                             # .venv); peer_parity.py --reuse ARGS started, and a loop committing its results on main
#                             # every 2 min (the sweep's grid now: --sweep-lr 3e-4 1e-3 3e-3 1e-2 3e-2)
#   $DEV/bench/campaign.sh stop   # both stopped, what landed committed, $DEV removed, main checked out here again
#
# Why: a kept run's key hashes the code that trains, exports and serves (bench/peer_runs.py's CODE: mtp_train,
# precompute, eval, ...), so any change there would retrain the 12 CPU-hours of runs; the campaign therefore runs the
# code of PIN, and its results go to $DEV/bench/peer_results on main. The keys also hold the target's absolute path:
# run it from the checkout the kept runs were made in (/work/main). `start` needs this checkout clean.
set -euo pipefail
PIN=838fd8ce35c8643bdc44ffbea70c48de4aad100a
if [[ -z "${CAMPAIGN_REPO:-}" ]]; then  # the checkout changes under a running script: run a copy
    here=$(cd "$(dirname "$0")/.." && pwd)
    repo=$(git -C "$here" worktree list --porcelain | awk 'NR == 1 {print $2; exit}')  # the main checkout
    cp "$0" /tmp/campaign-script.sh
    CAMPAIGN_REPO=$repo exec bash /tmp/campaign-script.sh "$@"
fi
REPO=$CAMPAIGN_REPO
DEV=${DEV:-$(dirname "$REPO")/dev}
LOGS=${LOGS:-/tmp/campaign}

commit_results() {
    cd "$DEV"
    if [[ -n "$(git status --porcelain bench/peer_results)" ]]; then
        git add bench/peer_results
        git commit -q -m "peer results: $(date -u +%H:%M)" -- bench/peer_results
    fi
}

case "${1:-}" in
start)
    cd "$REPO"
    [[ -z "$(git status --porcelain)" ]] || { echo "campaign.sh: $REPO has uncommitted changes; commit them first" >&2; exit 2; }
    git checkout -q --detach "$PIN"
    git worktree add -q "$DEV" main
    make venv smollm2 vllm peers speculators
    for d in .cache .venv-vllm .venv-peers .venv-speculators; do ln -sfn "$REPO/$d" "$DEV/$d"; done
    (cd "$DEV" && make venv)
    mkdir -p "$LOGS"
    nohup nice -n 5 "$REPO/.venv/bin/python" bench/peer_parity.py --reuse --results "$DEV/bench/peer_results" \
        "${@:2}" > "$LOGS/parity.log" 2>&1 &
    export -f commit_results
    export DEV
    nohup bash -c 'while true; do commit_results; sleep 120; done' > "$LOGS/commits.log" 2>&1 &
    echo "campaign.sh: running (log $LOGS/parity.log); develop in $DEV, on main"
    ;;
stop)
    pkill -f "while true; do commit_results" || true
    pkill -f bench/peer_parity.py || true
    pkill -9 -f "runs/peers/" || true
    pkill -9 -f "VLLM::" || true
    commit_results
    cd "$DEV"
    dirty=$(git status --porcelain | grep -v -E '^\?\? (\.cache|\.venv-vllm|\.venv-peers|\.venv-speculators)$' || true)
    [[ -z "$dirty" ]] || { echo "campaign.sh: $DEV has uncommitted changes; commit them, then stop again" >&2; exit 2; }
    cd "$REPO"
    git worktree remove --force "$DEV"
    git checkout -q main
    echo "campaign.sh: stopped; main is checked out in $REPO"
    ;;
*)
    echo "usage: bench/campaign.sh start|stop" >&2
    exit 2
    ;;
esac
