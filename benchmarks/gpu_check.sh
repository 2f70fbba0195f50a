#!/usr/bin/env bash
# gpu_check.sh: the GPU checks in one short script (about 8 minutes on one H200), for a machine that has CUDA,
# PyTorch and transformers but may have neither network nor this project's pinned versions.
#
#     bash benchmarks/gpu_check.sh [LOG_DIR]        # logs to LOG_DIR (default: $OUT, else /tmp/gpu-check)
#
# (1) bench.py's gpu section: bf16 generation, re-scoring (padded vs packed, with their max |diff|) and one
#     update at Qwen2.5-3B's shapes with random weights; (2) the default tiny run end to end on CUDA (bf16, two
#     updates, one evaluation with the self-analysis probe); (3) the test suite on 16 workers under that
#     machine's torch and transformers (the tests hide the GPU: they are CPU tests), one line per test in the log.
# Every step has its own time limit, so one that hangs costs only its own share.
set -u
LOG_DIR=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| transformers', transformers.__version__, '| cuda', torch.version.cuda, '| bf16', torch.cuda.is_bf16_supported())"
} 2>&1 | tee "$LOG_DIR/versions.log"
echo "== (1) bench.py --only gpu"
timeout 150 $PY benchmarks/bench.py --only gpu --repeats 3 2>&1 | tee "$LOG_DIR/bench_gpu.log"
echo "bench exit ${PIPESTATUS[0]}"
echo "== (2) python train.py --device cuda --updates 2"
start=$(date +%s)
timeout 200 $PY train.py --device cuda --updates 2 --eval-every 2 --out-dir /tmp/gpu-check-run --overwrite \
  > "$LOG_DIR/train_gpu.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s" | tee -a "$LOG_DIR/train_gpu.log"
grep -E "update [0-9]+/|valid_seen|valid_unseen|Error|error" "$LOG_DIR/train_gpu.log" | tail -12
echo "== (3) pytest on 16 workers"
timeout 240 $PY -m pytest -v -n 16 -p no:cacheprovider -p no:benchmark test_seed.py tests > "$LOG_DIR/pytest.log" 2>&1
echo "exit $?"  # 124: cut at its limit; the per-test lines above the cut are in the log
grep -E " (FAILED|ERROR) " "$LOG_DIR/pytest.log"; grep -E "passed|failed" "$LOG_DIR/pytest.log" | tail -1
