#!/usr/bin/env bash
# Every GPU check of the engine, in about 8 minutes (at most 17, each step has its own timeout) on one CUDA
# machine (prepared and dry-run on a CPU: tests/unit/worker/test_gpu_check_script.py runs it with
# GPU_CHECK_DRY_RUN=1).
#
# What the machine must have: Python 3.10+ with torch (CUDA), numpy, transformers, msgspec, pytest and
# pytest-timeout importable (the project's own code from this checkout, through PYTHONPATH); flash-attn is
# used when importable (no binary wheel exists on the package index: bring one in $FLASH_ATTN_WHEELS),
# else PyTorch's varlen op, else flex_attention. No network.
#
#   1. the tests marked gpu (tests/unit/worker): each kernel (flash-attn, PyTorch's varlen op with the
#      signature this torch has, flex_attention) against SDPA, kernel engines against the SDPA engine token
#      for token (the bundled model over 32 prompts in fp16, a Dream-style model with GQA and shifted
#      logits), steps replayed from CUDA graphs against the same steps run eagerly, no hidden host-device
#      synchronisation in a step, and TP-2 over NCCL where two GPUs exist;
#   2. python -m bench.engine --device cuda --arch llada-8b: LLaDA-8B's shape in bf16 with the LM
#      head scaled so that about 3 tokens pass 0.9 per step, gen 256, block 32; tokens/s and tokens per step
#      at batch 1, 8 and 32 for the engine (CUDA graphs), the engine without graphs and the no-cache loop;
#      the floor (the same model's dense cache step captured in one CUDA graph) beside the engine's
#      dual-cache step;
#   3. the acceptance: the engine's dual-cache step <= 1.3x the floor at batch 1, 8 and 32; tokens/s at batch 8
#      >= 5x batch 1 and >= 8x the no-cache loop at batch 8; several tokens per step; KV copied per cache
#      step <= 2x written;
#   4. the measured profile profiles/llada-8b-<gpu>-measured.json, made by the command a user calibrates with:
#      python -m calibrate.random_model writes a random-weight LLaDA-8B directory (LLaDA's layout, bf16, in a
#      temporary directory removed at exit), then `dls calibrate --device cuda --only profile` measures it
#      (prompt 256 + canvas 256, batches 1 to 32 or as far as memory allows, median of 3); TP > 1 from TP 1
#      through the modelled H100 profile's TP model (tp_scaling), as before.
#
# Usage: scripts/gpu-check.sh   (env: PYTHON, default .venv/bin/python else python3; OUT_DIR, default
#        runs/gpu-check: the log, the bench JSON and a copy of the profile go there; GPU_CHECK_DRY_RUN=1: the
#        same steps on a CPU with a tiny random model, for checking the script itself, never its figures)
# Exit: 0 every check passed; 1 a check failed or a step ran out of its time.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT_DIR=${OUT_DIR:-runs/gpu-check}
DRY=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT_DIR/gpu-check.log"
: >"$LOG"
failed=0
began=$SECONDS

say() { echo "== $*" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

say "machine"
if [ "$DRY" = 1 ]; then
    DEVICE=cpu ARCH=llada-tiny GPU=dryrun
    BENCH_ARGS=(--gen-length 32 --block-length 8 --batches 1,8 --loop-steps 2 --tokens-per-step 3
                --calibration-rounds 4 --floor --floor-batches 1,8 --floor-repeats 3 --profile-repeats 1)
    CALIBRATE_ARGS=(--prompt-tokens 16 --max-batch 8 --repeats 1)
    PROFILE="$OUT_DIR/llada-tiny-dryrun-measured.json"
    say "dry run on a CPU: the script's steps, not its figures"
else
    run nvidia-smi -L || true
    if ! run "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"; then
        say "FAILED: no CUDA device for $PY"; exit 1
    fi
    DEVICE=cuda ARCH=llada-8b
    GPU=$("$PY" -c "import re, torch; n = torch.cuda.get_device_name().replace('NVIDIA', '').split(); print(re.sub('[^a-z0-9]', '', n[0].lower()) if n else 'gpu')")
    BENCH_ARGS=()
    CALIBRATE_ARGS=(--prompt-tokens 256 --max-batch 32 --repeats 3)
    PROFILE="profiles/llada-8b-$GPU-measured.json"
fi

say "kernels"
if [ "$DRY" != 1 ] && [ -n "${FLASH_ATTN_WHEELS:-}" ] && ! "$PY" -c "import flash_attn" >/dev/null 2>&1; then
    run "$PY" -m pip install -q --no-index --find-links "$FLASH_ATTN_WHEELS" flash-attn einops || true
fi
run "$PY" -c "
import torch
from services.worker.attention.flash import flash_attn_importable
from services.worker.attention.select import resolve_backend
from services.worker.attention.varlen import torch_varlen_attn, varlen_features
device = torch.device('$DEVICE')
print('flash-attn importable:', flash_attn_importable(), '| torch varlen op:', torch_varlen_attn() is not None,
      sorted(varlen_features()), '| auto picks:', resolve_backend('auto', device, torch.bfloat16, 128).value)"

say "tests marked gpu"
if [ "$DRY" = 1 ]; then
    TESTS=(-m gpu --co -q tests/unit/worker)  # collected, not run: they need CUDA
else
    TESTS=(-m gpu -rs --timeout 120 tests/unit/worker)
fi
if ! run timeout 150 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
    say "FAILED: gpu tests"; failed=1
fi

say "bench: $ARCH"
BENCH="$OUT_DIR/bench-engine-speed-$ARCH-$GPU.json"
if run timeout 330 "$PY" -m bench.engine --device "$DEVICE" --arch "$ARCH" --json "$BENCH" "${BENCH_ARGS[@]}"; then
    say "acceptance"
    if ! run "$PY" - "$BENCH" "$DRY" <<'EOF'
import json, sys
figures, dry = json.load(open(sys.argv[1])), sys.argv[2] == "1"
tps, ratios, steps = figures["tokens_per_s_by_batch"], figures["ratios"], figures["tokens_per_step_by_batch"]
print("tokens/s by batch:", json.dumps(tps))
print("tokens per step:", json.dumps(steps), "| lm head x", figures["lm_head_scale"])
print("floor ms:", json.dumps(figures["floor_ms_by_batch"]), "| engine cache step ms:",
      json.dumps(figures["engine_cache_step_ms_by_batch"]), "| over the floor:", json.dumps(figures["engine_over_floor"]))
print("attention:", figures["attention_backend"], "| CUDA graphs:", figures["cuda_graphs"])
checks = {f"engine cache step <= 1.3x the floor at batch {b}": r <= 1.3 for b, r in figures["engine_over_floor"].items()}
checks |= {
    "engine batch 8 >= 5x batch 1": ratios["engine_batch8_over_batch1"] >= 5,
    "engine >= 8x the no-cache loop at batch 8": ratios["engine_over_no_cache_loop_at_batch_8"] >= 8,
    "several tokens per step (> 1.5 at batch 1)": steps["engine"]["1"] > 1.5,
    "kv copied <= 2x written per cache step": figures["kv_bytes_copied_per_cache_step"]
    <= 2 * figures["kv_bytes_written_per_cache_step"],
}
for name, ok in checks.items():
    print("PASS" if ok else "FAIL", name)
sys.exit(0 if dry or all(checks.values()) else 1)  # a dry run checks the script, not a CPU's figures
EOF
    then
        say "FAILED: acceptance"; failed=1
    fi
else
    say "FAILED: bench (or it ran past its 330 s)"; failed=1
fi

say "profile: dls calibrate --device $DEVICE --only profile ($ARCH, random weights)"
MODEL_TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-model.XXXXXX")
trap 'rm -rf "$MODEL_TMP"' EXIT
BUNDLE="$OUT_DIR/calibration-$ARCH"
rm -rf "$BUNDLE"
if run timeout 180 "$PY" -m calibrate.random_model --arch "$ARCH" --device "$DEVICE" --out "$MODEL_TMP/$ARCH" \
    && run timeout 240 "$PY" -m services.cli calibrate --model "$MODEL_TMP/$ARCH" --device "$DEVICE" --only profile \
        --out "$BUNDLE" "${CALIBRATE_ARGS[@]}" \
    && run "$PY" - "$BUNDLE/profile.json" "$PROFILE" "$ARCH" <<'EOF'
import json, sys
source, target, arch = sys.argv[1:4]
profile = json.load(open(source))
if arch == "llada-8b":  # the modelled profile's shape: its TP model gives the degrees one GPU cannot measure
    profile["tp_scaling"] = {"from_tp": 1, "like": "llada-8b-h100.json"}
    profile["notes"] += ("; TP 2, 4 and 8 are not measured: tp_scaling gives them from TP 1 through the modelled H100 "
                         "profile's tensor-parallel model (shared/profiles.py)")
with open(target, "w") as f:
    f.write(json.dumps(profile, indent=2) + "\n")
print(f"{target}: TP {', '.join(profile['tp'])}, batches {', '.join(profile['tp']['1']['cache_ms'])}, cache ms "
      f"{json.dumps(profile['tp']['1']['cache_ms'])}")
EOF
then
    [ "$(dirname "$PROFILE")" -ef "$OUT_DIR" ] || cp "$PROFILE" "$OUT_DIR/"
else
    say "FAILED: the profile through dls calibrate"; failed=1
fi

say "took $((SECONDS - began)) s"
if [ "$failed" = 1 ]; then say "gpu-check: FAILED"; exit 1; fi
say "gpu-check: passed"
