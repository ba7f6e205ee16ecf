#!/bin/bash
# The bundled model served as a user's checkpoint: a copy without its calibration, calibrated by
# `dls calibrate` on prompts like those it then serves (the short families' held-out mix, max_tokens 16),
# then the live overload comparison (bench.live_overload, 4 req/s: about 2x the paced workers' capacity
# at 0.9) on it: DiLaServe and fixed-0.9 once calibrated, DiLaServe before (uncalibrated), and a longer
# DiLaServe run for what shadow decoding costs at its default rate. About 15 minutes on 2 cores.
# Writes docs/bench/live-overload-{calibrated,uncalibrated,shadow}.json and the copy's manifest.
set -euo pipefail
PY=${PY:-.venv/bin/python}
WORK=${WORK:-runs/calibrated-overload}
SLO_MS=${SLO_MS:-11522.7}  # the SLO the short workload measured (5x the isolated latency at 0.9): one for every run
rm -rf "$WORK" && mkdir -p "$WORK"
for copy in calibrated uncalibrated; do
  $PY -c "import shutil, sys; shutil.copytree('models/dls-tiny', sys.argv[1], ignore=shutil.ignore_patterns('calibration', 'replay', 'MODEL_CARD.md'))" "$WORK/$copy"
done
$PY - "$WORK/prompts.jsonl" <<'PYEOF'
import json, sys
from shared.tasks import Split, TaskGenerator
problems = TaskGenerator(5).problems(240, 4, split=Split.HELD_OUT)  # the short mix, as the workload draws it
with open(sys.argv[1], "w") as f:
    for p in problems:
        f.write(json.dumps({"prompt": p.prompt, "max_tokens": 16}) + "\n")
PYEOF
set -x
$PY -m services.cli calibrate --model "$WORK/calibrated" --prompts "$WORK/prompts.jsonl" --cache-modes none --threads 2
cp "$WORK/calibrated/calibration/manifest.json" docs/bench/live-overload-calibration-manifest.json
$PY -m bench.live_overload --model "$WORK/calibrated" --rate 4 --duration 60 --slo-ms "$SLO_MS" \
  --run-dir "$WORK/runs-calibrated" --json docs/bench/live-overload-calibrated.json
$PY -m bench.live_overload --model "$WORK/uncalibrated" --policies dilaserve --rate 4 --duration 60 --slo-ms "$SLO_MS" \
  --run-dir "$WORK/runs-uncalibrated" --json docs/bench/live-overload-uncalibrated.json
$PY -m bench.live_overload --model "$WORK/calibrated" --policies dilaserve --rate 4 --duration 180 --slo-ms "$SLO_MS" \
  --run-dir "$WORK/runs-shadow" --json docs/bench/live-overload-shadow.json
