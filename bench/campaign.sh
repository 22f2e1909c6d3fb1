#!/usr/bin/env bash
# Issue #49's peer campaign (bench/peer_parity.py), resumed session after session, while development goes on beside
# it on main.
#
#   bench/campaign.sh start [ARGS]  # this checkout detached at $AT (default: its commit) and set up; main checked
#                             # out in $DEV (its own .venv); peer_parity.py --reuse ARGS started, and a loop committing
#                             # its results on main every 2 min
#   $DEV/bench/campaign.sh stop   # both stopped, what landed committed, $DEV removed, main checked out here again
#
# Why: the code under a running campaign must not change, since our runs' keys hash the code that trains, exports and
# serves them (bench/peer_runs.py's CODE), read when the campaign starts; so it runs a detached checkout and its
# results go to $DEV/bench/peer_results on main. The next start, at a newer commit, retrains our runs (minutes each)
# and keeps the peers' (hours), whose keys hold their inputs' content and their own code only. The keys also hold the
# target's absolute path: run it from the checkout the kept runs were made in (/work/main). `start` needs this
# checkout clean. Our runs are kept only at the commit they were made at, so a campaign that spans sessions runs at
# one commit throughout (AT=639d0aa: bench/RESULTS.md, issue #49), whatever main has become.
set -euo pipefail
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
    git checkout -q --detach "${AT:-HEAD}"
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
