#!/bin/bash
# Everything the bundled model ships with, measured from its weights (run from the repository root
# after `dls train-model` has written models/dls-tiny): the engine benchmark, the model card and the
# quality curves, the step predictor's traces and models, its benchmark, the CPU step profile and the
# simulator's replay traces.
# About an hour on a 2-core CPU; progress goes to stderr.
set -euo pipefail
MODEL=${MODEL:-models/dls-tiny}
DLS=".venv/bin/dls"
PY=".venv/bin/python"
set -x
# 1. accuracy and steps per threshold, per family and canvas length; forwards saved by early stop
# 300 problems per family and canvas: the quality budget is 1 point, and at 100 a point is one answer in a family
$PY -m bench.engine --model "$MODEL" --threads 2 --canvas-problems 300 --json docs/bench/engine.json
# 2. MODEL_CARD.md and quality.json (the curves the quality budget reads)
$PY -m bench.model_card --bench docs/bench/engine.json --model "$MODEL"
# 3. predictor traces over every family, canvases 16-128 and blocks 8-32, then the served and one-shot models
$DLS collect-traces --model "$MODEL" --out-dir data/predictor --train-requests 1600 --heldout-requests 400 \
    --gen-lengths 16,32,64,128,128,128 --block-lengths 8,8,16,32
$DLS train-predictor --traces data/predictor/train.csv --eval data/predictor/heldout.csv --out "$MODEL/calibration/predictor"
# 4. the predictor's errors, granularity study and cost
$PY -m bench.predictor --model "$MODEL" --traces-dir data/predictor --json docs/bench/predictor.json
# 5. the CPU step-latency profile (context: a 5-shot prompt plus the default canvas); it depends on the
#    architecture, not on the weights, so a retrained model of the same shape keeps the committed one
$DLS profile --model "$MODEL" --context-tokens 192 --output "$MODEL/calibration/profile.json"
# 6. the simulator's replay traces of the presets' shapes (recorded by their first run, minutes each),
#    shipped gzipped beside the weights so that a clean checkout's benchmarks load them
KEY=$($PY -c "from sim.engines import model_key; print(model_key('$MODEL'))")
rm -f "$MODEL"/replay/*.json.gz
for P in paper-bench paper-trace paper-bench-long; do $DLS sim --preset $P --quick --policy infaas > /dev/null; done
mkdir -p "$MODEL/replay"
for f in runs/sim/replay/trace-v5-"$KEY"-*.json; do gzip -9 -n -c "$f" > "$MODEL/replay/$(basename "$f").gz"; done
