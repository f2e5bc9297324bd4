#!/usr/bin/env bash
# The prepared GPU check (issue 36, item 6): under 8 minutes on one GPU, as it is.
#
#   scripts/gpu_check.sh [OUT.json]          (default: gpu_check.json in the current directory)
#
# 1. prints the versions (python, torch + CUDA, triton, fla-core, mamba-ssm, the GPU); installs
#    nothing: it uses $PYTHON, else the repository's .venv/bin/python, else python3;
# 2. runs the CUDA-marked tests (tests/test_cuda.py: ops, models, decoding and training on the
#    device against the CPU, and each peer backend against the torch backend) under a time limit
#    ($GPU_CHECK_TESTS_S seconds, default 200), log in OUT.pytest.log;
# 3. runs scripts/gpu_bench.py (train step and generate, bf16, d_model 1024, 24 layers, T 2048 and
#    8192: mnemo auto vs torch backend, fla's HF models, mamba-ssm's MambaLMHeadModel) in the time
#    left of the 8 minutes, and writes one JSON with the tests' summary, the versions and the cases
#    (rewritten after every case: a benchmark stopped by the time limit leaves "complete": false).
#
# Exit status: 0 when the tests passed and the JSON was written; otherwise the first failure's
# (pytest: 5 = no test ran, e.g. no CUDA device). GPU_BENCH_ARGS adds options to gpu_bench.py.
set -u
START=$(date +%s)
TOTAL_S=${GPU_CHECK_TOTAL_S:-440}            # margin under the 8 minutes
TESTS_S=${GPU_CHECK_TESTS_S:-200}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-gpu_check.json}")
LOG="${OUT%.json}.pytest.log"
mkdir -p "$(dirname "$OUT")"

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's mnemo

echo "== versions ($PY)"
"$PY" - <<'EOF'
import importlib.util, sys
sys.path.insert(0, "scripts")
from gpu_bench import versions
for k, v in versions().items():
    print(f"  {k:14s} {v}")
import torch
if not torch.cuda.is_available():
    print("  no CUDA device: the tests skip and the benchmark runs on the CPU (use --tiny there)")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== CUDA-marked tests (limit ${TESTS_S} s, log $LOG)"
timeout --kill-after=10 "$TESTS_S" "$PY" -m pytest -q -m cuda -p no:cacheprovider --durations=5 tests/test_cuda.py >"$LOG" 2>&1
TESTS_RC=$?
tail -n 3 "$LOG"
[ "$TESTS_RC" = 124 ] && echo "  (the tests ran past ${TESTS_S} s and were stopped)"

LEFT=$(( TOTAL_S - ($(date +%s) - START) - 20 ))   # 20 s for start-up and writing
[ "$LEFT" -lt 60 ] && LEFT=60
echo "== model benchmark (budget ${LEFT} s) -> $OUT"
# $GPU_BENCH_ARGS: more options for gpu_bench.py (e.g. "--tiny" to try this script on a CPU)
# shellcheck disable=SC2086
timeout --kill-after=10 $(( LEFT + 30 )) "$PY" scripts/gpu_bench.py --out "$OUT" --budget-s "$LEFT" \
    --tests-log "$LOG" --tests-rc "$TESTS_RC" ${GPU_BENCH_ARGS:-}
BENCH_RC=$?
echo "== done in $(( $(date +%s) - START )) s: tests rc $TESTS_RC, benchmark rc $BENCH_RC"
[ "$TESTS_RC" != 0 ] && exit "$TESTS_RC"
exit "$BENCH_RC"
