#!/bin/bash
# Live stack vs simulator on the same arrivals (docs/live-vs-sim.md), one rate per call:
#   scripts/live-vs-sim.sh PRESET RATE NUM_REQUESTS [OUT_DIR]
# PRESET live-local (short answers, no cache) or live-local-long (the chain family, max_tokens 128 in
# blocks of 32, dual cache: the preset's canvas and block). Writes OUT_DIR/{arrivals,sim,live,sim-cp}-RATE.*
# and the stack's log; run from the repository root on an otherwise idle machine.
# sim-RATE: the simulator with the GPU profile alone; sim-cp-RATE: plus the live stack's control-plane time
# per step, CONTROL_PLANE_MS if set, else what the live run measured (`dls loadgen --timelines`).
set -euo pipefail
PRESET=$1 RATE=$2 N=$3 OUT=${4:-runs/live-vs-sim}
DLS=.venv/bin/dls PY=.venv/bin/python
mkdir -p "$OUT"
if [ "$PRESET" = live-local-long ]; then
  read -r GEN BLOCK < <($PY -c "from sim.presets import PRESETS; w = PRESETS.get('live-local-long').workload; \
print(w.gen_len, w.block_len)")
  SHAPE=(--family chain --gen-len "$GEN" --block-len "$BLOCK") CACHE=dual
else
  SHAPE=() CACHE=none
fi
set -x
# 1. the arrivals, saved as a CSV both sides replay
$DLS loadgen --rate "$RATE" --num-requests "$N" --num-shots 5 "${SHAPE[@]}" --dry-run --save-trace "$OUT/arrivals-$RATE.csv" > /dev/null
# 2. the simulator on them, as sent (it prints the SLO and records the pacing in its setup)
$DLS sim --preset "$PRESET" --trace "$OUT/arrivals-$RATE.csv" --time-scale 1 --json "$OUT/sim-$RATE.json" > "$OUT/sim-$RATE.txt" 2>&1
read -r SCALE CONTEXT SLO_MS CURVE < <($PY -c "import json,sys; s=json.load(open(sys.argv[1]))['setup']; \
print(s['step_time_scale'], s['profile_anchor_context_tokens'], round(s['slo_s']*1000), s['quality_curve_key'])" \
    "$OUT/sim-$RATE.json")
# the quality budget on the same curve as the simulator's (so both have the same candidate thresholds)
export DLS_SCHEDULER_QUALITY_CURVES="[\"$CURVE\"]"
# 3. the live stack paced as the simulator times steps
PORT=$($PY -c "from shared.runtime import free_port; print(free_port())")
export DLS_NATS_URL=nats://127.0.0.1:$($PY -c "from shared.runtime import free_port; print(free_port())")
export DLS_REDIS_URL=redis://127.0.0.1:$($PY -c "from shared.runtime import free_port; print(free_port())")/0
$DLS up --port "$PORT" --workers 2 --pace profiles/llada-8b-h100.json --pace-scale "$SCALE" --pace-context "$CONTEXT" \
    --run-dir "$OUT/stack-$RATE" > "$OUT/stack-$RATE.log" 2>&1 &
STACK=$!
trap 'kill -INT $STACK 2>/dev/null; wait $STACK 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$PORT/readyz" | grep -q '"serving": *true' && break
  sleep 1
done
# 4. the same arrivals, prompts and SLO against it
$DLS loadgen --url "http://127.0.0.1:$PORT" --trace "$OUT/arrivals-$RATE.csv" --slo-ms "$SLO_MS" --num-shots 5 \
    "${SHAPE[@]}" --cache "$CACHE" --warmup 3 --timelines --json "$OUT/live-$RATE.json" > "$OUT/live-$RATE.txt" 2>&1
kill -INT $STACK; wait $STACK 2>/dev/null || true
trap - EXIT
# 5. the simulator again, given the control-plane time per step
CP=${CONTROL_PLANE_MS:-$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['control_plane']['mean_ms'])" \
    "$OUT/live-$RATE.json")}
$DLS sim --preset "$PRESET" --trace "$OUT/arrivals-$RATE.csv" --time-scale 1 --control-plane-ms "$CP" \
    --json "$OUT/sim-cp-$RATE.json" > "$OUT/sim-cp-$RATE.txt" 2>&1
