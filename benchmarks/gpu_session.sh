#!/usr/bin/env bash
# Everything a short loan of a GPU machine should check, in one command (see docs/ARCHITECTURE.md, "GPU"):
#   1. the CUDA-marked tests (pytest -m gpu), four at a time;
#   2. at the same time, the DLRM main job on one GPU with a hand-written mixed plan (examples/plan_mixed_1gpu.yaml:
#      table-wise and data-parallel lookups on one process), its checkpoint, and a resume of it for a second epoch;
#   3. then, alone on the machine, benchmarks/bench_gpu.py (its world-size-2 part runs 2 processes on the one
#      GPU over gloo).
# Logs go to $OUT (the device tool's output folder; /tmp/gpu_session elsewhere). Wheels of the packages the
# machine lacks (fbgemm-gpu-cpu, jsonargparse and its needs) are installed from $WHEELS (.whl/) when it is there.
# On a machine without CUDA it runs too: the tests skip, the main job and the benchmark say why they stop.
#
#   bash benchmarks/gpu_session.sh                  # PY=python3 by default; BENCH_ARGS="--steps 5" to shorten
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_session}
PY=${PY:-python3}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl \
        >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD  # the examples import lightning_rec from this checkout
start=$(date +%s)
stamp() { echo "[$(($(date +%s) - start)) s] $*"; }

{
    nvidia-smi -L 2>&1
    $PY - <<'EOF'
import torch, lightning, torchmetrics
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print("lightning", lightning.__version__, "torchmetrics", torchmetrics.__version__)
import fbgemm_gpu, lightning_rec
from lightning_rec import kernels
print("fbgemm_gpu", getattr(fbgemm_gpu, "__version__", "?"), "lightning_rec", lightning_rec.__version__)
EOF
} >"$OUT/env.log" 2>&1
stamp "environment" && cat "$OUT/env.log"

# 1 and 2 together: the tests use little of the GPU, the main job one process.
(timeout "${TESTS_TIMEOUT:-240}" $PY -m pytest -m gpu tests -q -rA -p no:cacheprovider -n 4 \
    --timeout 180 >"$OUT/tests.log" 2>&1; echo "pytest exit $?" >>"$OUT/tests.log") &
tests_pid=$!

RUN=/tmp/gpu_session_dlrm
rm -rf "$RUN"
common=(--config examples/plan_mixed_1gpu.yaml --trainer.accelerator "${ACCELERATOR:-cuda}"
    --trainer.default_root_dir "$RUN" --trainer.logger.init_args.save_dir "$RUN" ${DLRM_ARGS:-})
{
    timeout "${DLRM_TIMEOUT:-150}" $PY examples/dlrm.py "${common[@]}"
    echo "dlrm exit $?"
    stamp "resume"
    timeout "${DLRM_TIMEOUT:-150}" $PY examples/dlrm.py "${common[@]}" --trainer.max_epochs 2 \
        --ckpt_path "$RUN/checkpoints/dlrm-final.ckpt"
    echo "dlrm resume exit $?"
} 2>&1 | grep -v "━" >"$OUT/dlrm.log"
stamp "main job done"
grep -E "^final:|exit|Error|error" "$OUT/dlrm.log" | tail -8
wait "$tests_pid"
stamp "tests done"
tail -30 "$OUT/tests.log"

timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/bench_gpu.py --out "$OUT/gpu.md" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
echo "bench exit $?" >>"$OUT/bench.log"
stamp "benchmark done"
tail -45 "$OUT/bench.log"
