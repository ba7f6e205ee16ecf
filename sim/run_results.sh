#!/bin/bash
# The commands behind docs/results.md (run from the repository root).
set -x
D=runs/sim
mkdir -p "$D"
/usr/bin/time -f "wall %e s" nice -n 10 .venv/bin/dls compare --preset paper-bench --quick --json $D/paper-bench-quick.json --plot $D/paper-bench-quick.png > $D/paper-bench-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --json $D/paper-trace-quick.json --plot $D/paper-trace-quick.png > $D/paper-trace-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --trace tests/data/burstgpt_sample.csv --json $D/paper-trace-burstgpt-quick.json > $D/paper-trace-burstgpt-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --trace tests/data/AzureLLMInferenceTrace_conv_first10min.csv --json $D/paper-trace-azure-quick.json --plot $D/paper-trace-azure-quick.png > $D/paper-trace-azure-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --trace tests/data/AzureLLMInferenceTrace_code_first10min.csv --json $D/paper-trace-azure-code-quick.json > $D/paper-trace-azure-code-quick.txt 2>&1
for P in paper-bench-long ablation-threshold-long ablation-predictor-long ablation-loadctl-long; do
  nice -n 10 .venv/bin/dls compare --preset $P --quick --json $D/$P-quick.json --plot $D/$P-quick.png > $D/$P-quick.txt 2>&1
done
nice -n 10 .venv/bin/dls compare --preset paper-bench-long --json $D/paper-bench-long.json --plot $D/paper-bench-long.png > $D/paper-bench-long.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset ablation-threshold --quick --json $D/ablation-threshold-quick.json --plot $D/ablation-threshold-quick.png > $D/ablation-threshold-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-bench --no-fidelity --policies dilaserve,infaas,llumnix,dilaserve-all-thresholds --json $D/paper-bench.json --plot $D/paper-bench.png > $D/paper-bench.txt 2>&1
for P in ablation-loadctl ablation-predictor ablation-migration ablation-cache mixed-slo sweep-input; do
  nice -n 10 .venv/bin/dls compare --preset $P --quick --json $D/$P-quick.json > $D/$P-quick.txt 2>&1
done
# the headline runs again on the profile measured on an H200 (docs/results.md, "The headlines on a measured profile")
M=profiles/llada-8b-h200-measured.json
nice -n 10 .venv/bin/dls compare --preset paper-bench --quick --no-fidelity --profile $M --json $D/paper-bench-quick-h200.json > $D/paper-bench-quick-h200.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-bench-long --quick --profile $M --json $D/paper-bench-long-quick-h200.json > $D/paper-bench-long-quick-h200.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --profile $M --trace tests/data/AzureLLMInferenceTrace_conv_first10min.csv --json $D/paper-trace-azure-quick-h200.json > $D/paper-trace-azure-quick-h200.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset paper-trace --quick --profile $M --trace tests/data/AzureLLMInferenceTrace_code_first10min.csv --json $D/paper-trace-azure-code-quick-h200.json > $D/paper-trace-azure-code-quick-h200.txt 2>&1
nice -n 10 .venv/bin/dls capacity --preset paper-bench --quick --policy dilaserve --target 0.9 --json $D/capacity-dilaserve.json > $D/capacity.txt 2>&1
nice -n 10 .venv/bin/dls capacity --preset paper-bench --quick --policy infaas --target 0.9 --json $D/capacity-infaas.json >> $D/capacity.txt 2>&1
# several models: GPUs divided between two models whose mix flips (sim/multimodel.py), and with a 2-s switch
nice -n 10 .venv/bin/dls compare --preset multi-model --quick --json $D/multi-model-quick.json > $D/multi-model-quick.txt 2>&1
nice -n 10 .venv/bin/dls compare --preset multi-model --quick --switch-s 2 --policies dilaserve,per-model --json $D/multi-model-quick-switch2.json > $D/multi-model-quick-switch2.txt 2>&1
.venv/bin/python -m sim.results_doc  # writes docs/results.md from the JSON files
