#!/usr/bin/env bash
# Interleaved before/after runs of the fake-engine frame-latency bench, so both sides see the
# same machine load. "before" is the rtts package of a git ref (imported through PYTHONPATH),
# "after" is this working tree; both run on this checkout's .venv.
#   scripts/ab-fake-bench.sh main 8
# One row per run: time side p50_ms p99_ms ttfa_p50_s idle_alive server_cpu_% load1
set -euo pipefail
cd "$(dirname "$0")/.."
REF=${1:-main}
PAIRS=${2:-6}
BEFORE=$(mktemp -d)
trap 'rm -rf "$BEFORE"' EXIT
git archive "$REF" rtts | tar -x -C "$BEFORE"
parse='import sys,json; t=sys.stdin.read(); j=json.loads(t[t.index("{\n"):]); print(j["frame_latency_p50_ms"], j["frame_latency_p99_ms"], round(j["ttfa_p50_s"],3), j["idle_alive_after_hold"], j["server_cpu_percent"])'
for _ in $(seq "$PAIRS"); do
  for side in before after; do
    if [ "$side" = before ]; then export PYTHONPATH="$BEFORE"; else unset PYTHONPATH; fi
    row=$(.venv/bin/python -m rtts --log-level WARNING bench fake --streams 200 --idle 1000 2>&1 \
          | python3 -c "$parse")
    echo "$(date -u +%T) $side $row $(cut -d' ' -f1 /proc/loadavg)"
  done
done
