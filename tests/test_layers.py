"""Imports only point down: every module of ``spader_pipeline`` imports from its own package or from
a lower layer, never from a higher one (nor from a sibling of its own layer).

The order below is the one place it is written. Why each layer sits where it does:

* leaves: the package root (``__version__``), strict typed settings, local-server helpers
  (ports, processes), a local Ray's start, the data-root lock and the host-memory helpers; standard library and
  third-party code only;
* over the leaves: ``child_process``, which bounds its children's heap with ``host_memory``; and
  ``tracking``, MLflow (the store, the runs and what is logged into them, the buffered writer, the
  UI server) for every layer above that logs: the trainers and the verl plugin as well as the Kedro
  shell;
* core: the methods' maths (``algorithms``) and the models (``modeling``), pure torch/numpy;
* ``retrieval``: indexes, the search service and its client;
* ``agent``: the search agent's protocol, prompts and rollouts, over retrieval's schemas and the models;
  its top, ``engines``, loads the rollout engines by name for the drivers above (so it sits over them);
* ``data``: dataset readers and the VERL parquet rows, which carry the agent's rendered prompt;
* drivers of the agent: the native trainer, the verl plugin (everything verl calls) and the
  evaluator; they are independent of each other;
* over the drivers: ``launch`` builds and starts verl runs (command line, environment, retrieval
  service); ``reporting`` turns histories and evaluation records into the reports (statistics over
  the evaluator's bootstrap, tables, figures);
* ``training``: the ``training`` settings typed once and the table of backends that train (the native
  trainer's stages, a verl launch);
* ``portable`` runs a whole experiment from a bundle without Kedro or MLflow: the native stages in
  the chain's order, its report from ``reporting``;
* the Kedro shell: ``pipelines`` (thin nodes), then ``hooks``, which read the compare pipeline's cells; then Kedro's entry points,
  and ``grid``, which runs a registered pipeline's cells on Ray through Kedro's command line (over the hooks' data root).

Inside every package and subpackage (``native``, ``algorithms.methods``, ``pipelines.compare``…),
the same rule holds between its modules: :data:`PACKAGE_LAYERS` lists each package's modules (and
subpackages) bottom first, with the reason for the order, and a module imports only modules of
lower layers of its package (and, as everywhere, lower top-level layers). A package's ``__init__``
(and ``__main__``) is its top: it may export any of its modules. Together the two orders leave no
import circle anywhere (:func:`test_no_import_circle`, which checks that on the whole graph).

Imports inside functions and ``if TYPE_CHECKING:`` blocks count as well; relative imports are
resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "spader_pipeline"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: bottom first; a module may import its own top-level package and those of lower layers
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "typed_config", "local_servers", "local_ray", "run_lock", "host_memory", "bf16_switch"),
    ("child_process", "tracking"),
    ("algorithms", "modeling"),
    ("retrieval",),
    ("agent",),
    ("data",),
    ("native", "verl_plugin", "evaluation"),
    ("launch", "reporting"),
    ("training",),
    ("portable",),
    ("pipelines",),
    ("hooks",),
    ("settings", "pipeline_registry", "__main__", "grid"),
)
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}

#: inside a package, bottom first; ``__init__`` and ``__main__`` are each package's top layer
PACKAGE_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "native": (
        ("config", "records", "manifest", "rng"),  # the trainer's settings; what a run writes beside it
        ("checkpoint", "batch"),  # checkpoints and the resume policy; trajectories laid out as tensors
        ("update", "validation"),  # the loss and the optimiser step; greedy validation
        ("metrics",),  # a step's metrics, over its batch and update
        ("trainer", "warm_start"),  # the RL loop, read top to bottom; the warm start before it
        ("stages",),  # the chain's native stages and their child-process entries
    ),
    "agent": (
        ("protocol", "prompts", "question_grammar"),  # the tag grammar, the prompt templates, question words
        ("types", "question_facets"),  # trajectories, sampling and rollout settings; a question's facets
        ("search_step", "state_capture"),  # one search turn; the states a rollout keeps for the update
        ("rollout",),  # the agent loop over any Generator
        ("tokens", "scripted", "openai_backend", "decode_engine"),  # token layout; model-free, remote, local decoding
        ("hf_backend",),  # the in-process Generator: the token layout over the decode engine
        ("engines",),  # rollout engines by name (hf: the in-process Generator), what every driver builds
    ),
    "retrieval": (
        ("bm25s_import", "schemas", "budget", "corpus", "rerank"),  # wire types, the corpus, leaves
        ("tokenize", "wire", "client", "datasets"),  # analysers, the response format, the HTTP client
        ("bm25",),  # the BM25 index
        ("bm25_sharded", "dense", "lucene"),  # the indexes over BM25's pieces
        ("service",),  # searching an index in process
        ("index", "server"),  # building and loading indexes; the HTTP service
        ("settings", "cli"),  # where a stage's searches go; the command line
    ),
    "modeling": (
        ("triton_decode_kernel", "triton_step_kernels", "gguf_checkpoint"),  # the static step's Triton kernels
                                                      # (the modules import Triton); a GGUF file read once
        ("packed_linear", "native_step", "triton_attention", "triton_step"),  # oneDNN's weight layout; the decoding
                                                      # step and attention in C++; the attention and the work
                                                      # between the products in Triton
        ("decode_attention",),  # the bf16 cache's decoding attention
        ("device", "precision", "attention", "tokenizer", "batching", "kv_cache", "shared_prefix",
         "memory_budget", "packaged", "sampling", "static_cache"),  # each one concern of running a model
        ("decode_step",),  # one decoding step over fused packed weights (in C++ where it builds)
        ("graph_decode",),  # the GPU's decoding steps: static cache, sampled on the device, CUDA graphs; it
                            # reuses the fused step's norms and the boundary capture's block, and decode calls it
        ("base_model", "boundary", "decode"),  # loading and training a model; decoding with it
        ("provide", "warm_start"),  # the base model of a run; supervised fine-tuning
    ),
    "algorithms": (
        ("matching", "steps", "step_metrics", "validation"),  # answer matching; a trajectory's steps; their
                                                              # rollout metrics; the validation schedule
        ("advantages", "entity_search"),  # the estimators over steps; gold entities in retrieved documents
        ("rewards",),  # the reward terms (outcome, SPADER's exploration, tool cost)
        ("methods",),  # each method: its reward layout and estimator, registered by name
        ("group_metrics",),  # a group's mechanism metrics, comparing methods' advantages
    ),
    "algorithms.advantages": (
        ("_groups",),  # per-group statistics every estimator uses
        ("grpo", "spa"),  # GRPO's group-normalised outcome; SPADER's step-wise peer advantage
        ("calibadv", "tspo"),  # the estimators built on GRPO's
    ),
    "algorithms.methods": (
        ("base",),  # the method registry and what a method is
        ("grpo", "spader", "calibadv", "tspo"),  # one module per method, registering itself
    ),
    "data": (
        ("schema", "wiki"),  # the unified row; the embedded Wikipedia summaries
        ("formats", "readers", "validation"),  # VERL parquet rows; benchmark readers; the quarantine
        ("embedded_qa",),  # questions from articles sharing a description
        ("multi_search_qa",),  # questions that need several searches, over embedded_qa's groups
    ),
    "evaluation": (
        ("bootstrap", "metrics", "models"),  # intervals; per-question scores; what a model entry is
        ("config", "plots", "runner"),  # the typed `evaluate` block; figures; one dataset's evaluation
        ("mlflow_runs", "suite"),  # an evaluation's MLflow run; every model × dataset
    ),
    "launch": (
        ("settings", "overrides", "metrics", "process"),  # typed launch settings; Hydra overrides; verl's
                                                           # metrics files; the process runner
        ("data_files",),  # the parquet and the search tool's config a launch reads
        ("command",),  # the command line and environment of a launch
        ("verl", "merge"),  # a launch, step by step; merging its checkpoint
    ),
    "reporting": (
        ("tables", "portable"),  # markdown tables; the portable run's summary
        ("compare", "positive_control", "training"),  # the reports over runs and evaluation records
    ),
    "training": (
        ("registry",),  # the table of backends (no settings, so the settings can look names up in it)
        ("settings",),  # `training` typed once; the trainer's configuration built once
        ("backends",),  # the native and verl backends, registered as the package is imported
    ),
    "portable": (
        ("bundle", "methods"),  # a bundle's files and settings; one method's stage
        ("run",),  # the whole run in the chain's order
    ),
    "tracking": (
        ("store", "runs", "buffer", "provenance", "ui"),  # the store; runs; the buffered writer; lineage; the UI
        ("metrics_files",),  # metrics files a process writes, followed into the buffered writer
    ),
    "verl_plugin": (
        ("gaps", "estimators", "registration", "search_tool", "trajectory"),  # verl's mended gaps; our estimators,
                                                                             # registrations, tool, trajectories
        ("agent_loop", "batch_reward", "method_configs", "reward_manager", "cpu", "decoder_rollout"),
        # the agent loop, the batch reward assembly, the methods' Hydra configs, the reward manager, the
        # CPU platform and our rollout server: each over the leaves, independent of each other
    ),
    "verl_plugin.decoder_rollout": (
        ("batching", "names", "weights"),  # request batching; registered names; weight sync
        ("server",),  # the rollout server over our decoder
        ("replica",),  # verl's replica around the server
    ),
    "verl_plugin.cpu": (
        ("platform",),  # verl's platform for CPU workers
    ),
    "pipelines": (
        ("base_model", "data_prep", "index_build", "merge", "report", "training"),  # the chain's stages
        ("evaluate", "warm_start"),  # evaluation (over merge's manifests); the warm start (training's nodes)
        ("compare",),  # method × seed cells over the stages
        ("positive_control",),  # the fitted cells over compare's seeding
        ("positive_control_verl",),  # the fitted cells through verl too, beside positive_control's
    ),
    **{f"pipelines.{stage}": (("nodes",), ("pipeline",))  # thin nodes; the pipeline that wires them
       for stage in ("base_model", "compare", "data_prep", "evaluate", "index_build", "merge", "positive_control",
                     "positive_control_verl", "report", "training")},
    "pipelines.warm_start": (("pipeline",),),
    "grid": (
        ("settings", "phases", "child", "tasks"),  # resources; the pipeline's parts; a job's process; its Ray task
        ("driver",),  # the whole grid, its lock and its MLflow run
    ),
}
TOP_OF_PACKAGE = ("__init__", "__main__")


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """The top-level part of a ``spader_pipeline`` module (``""`` for the package root)."""
    return module.split(".")[1] if "." in module else ""


def is_module(module: str) -> bool:
    path = SRC.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every ``spader_pipeline`` module that ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source
            for alias in node.names:  # ``from spader_pipeline import tracking`` imports a module
                if is_module(f"{source}.{alias.name}"):
                    yield node.lineno, f"{source}.{alias.name}"


def upward_imports() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        here = part_of(name)
        for line, target in imported_modules(path):
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            there = part_of(target)
            if there == here or LAYER_OF[there] < LAYER_OF[here]:
                continue
            found.append(f"{name} (line {line}) imports {target}: layer {LAYERS[LAYER_OF[there]]} "
                         f"is not below {LAYERS[LAYER_OF[here]]}")
    return found


def module_of(module: str, package: str) -> str | None:
    """The module (or subpackage) of ``package`` that ``module`` is or lies in; ``__init__`` for the
    package itself; ``None`` outside it."""
    prefix = f"{PACKAGE}.{package}"
    if module == prefix:
        return "__init__"
    return module.split(".")[package.count(".") + 2] if module.startswith(prefix + ".") else None


def upward_imports_in(package: str) -> list[str]:
    """Imports between the modules of ``package`` that do not point down its :data:`PACKAGE_LAYERS`.
    A bare import of the package (``from spader_pipeline.native import stages`` also names the
    package) is not one: only the modules it names count."""
    rank = {part: k for k, parts in enumerate(PACKAGE_LAYERS[package]) for part in parts}
    rank.update({top: len(PACKAGE_LAYERS[package]) for top in TOP_OF_PACKAGE})
    found = []
    for path in sorted(package_dir(package).rglob("*.py")):
        name = module_name(path)
        here = module_of(name, package)
        for line, target in imported_modules(path):
            there = module_of(target, package)
            if there is None or there == here or there == "__init__":
                continue
            if rank[there] >= rank[here]:
                found.append(f"{name} (line {line}) imports {target}: {package}.{there} is not below {package}.{here}")
    return found


def package_dir(package: str) -> Path:
    return SRC.joinpath(*package.split("."))


def test_every_package_has_an_order():
    """Every package and subpackage of ``src/`` has its order in :data:`PACKAGE_LAYERS`."""
    packages = {".".join(p.parent.relative_to(SRC).parts) for p in SRC.rglob("__init__.py") if p.parent != SRC}
    assert packages - set(PACKAGE_LAYERS) == set(), "add the new package's order to PACKAGE_LAYERS"


def test_no_import_circle():
    """No module reaches itself through imports (a package's own ``__init__``, which re-exports its
    modules, is not followed from inside the package)."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {target for _, target in imported_modules(path) if target.startswith(PACKAGE + ".")
                       and target != name and not (is_package(target) and name.startswith(target + "."))
                       and not (path.name == "__init__.py" and target == package)}
    circles = []
    for start in sorted(graph):
        seen, stack = set(), [(start, (start,))]
        while stack:
            node, trail = stack.pop()
            for target in graph.get(node, ()):
                if target == start:
                    circles.append(" -> ".join((*trail, target)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, (*trail, target)))
    assert circles == []


def is_package(module: str) -> bool:
    return (SRC.joinpath(*module.split(".")[1:]) / "__init__.py").is_file()


def test_every_module_of_an_ordered_package_has_a_layer():
    for package, layers in PACKAGE_LAYERS.items():
        modules = {module_of(module_name(p), package) for p in package_dir(package).rglob("*.py")}
        listed = {m for parts in layers for m in parts} | set(TOP_OF_PACKAGE)
        assert modules - listed == set(), f"add the new module of {package} to PACKAGE_LAYERS"
        assert {m for parts in layers for m in parts} - modules == set(), f"{package}: a listed module is gone"


def test_imports_point_down_inside_ordered_packages():
    assert [found for package in PACKAGE_LAYERS for found in upward_imports_in(package)] == []


def test_every_top_level_module_has_a_layer():
    parts = {part_of(module_name(p)) for p in SRC.rglob("*.py")}
    assert parts - set(LAYER_OF) == set(), "add the new package or module to LAYERS"


def test_imports_only_point_down():
    assert upward_imports() == []


def test_the_walk_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an upward import hidden in a function, and a relative one, are found."""
    root = tmp_path / PACKAGE
    for folder in ("algorithms", "launch", "pipelines"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "algorithms" / "bad.py").write_text("def f():\n    from spader_pipeline.launch import x\n")
    (root / "launch" / "worse.py").write_text("from ..pipelines import y\n")
    (root / "pipelines" / "fine.py").write_text("from ..algorithms import bad\nfrom spader_pipeline import launch\n")
    monkeypatch.setitem(globals(), "SRC", root)
    found = upward_imports()
    assert len(found) == 2
    assert found[0].startswith("spader_pipeline.algorithms.bad (line 2) imports spader_pipeline.launch")
    assert found[1].startswith("spader_pipeline.launch.worse (line 1) imports spader_pipeline.pipelines")


def test_the_walk_inside_a_package_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself, inside a package: the trainer's config importing the trainer is found."""
    root = tmp_path / PACKAGE / "native"
    root.mkdir(parents=True)
    (root.parent / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .trainer import train\n")
    (root / "config.py").write_text("def f():\n    from spader_pipeline.native.trainer import train\n")
    (root / "trainer.py").write_text("from .config import f\nfrom spader_pipeline import native\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path / PACKAGE)
    assert upward_imports_in("native") == [
        "spader_pipeline.native.config (line 2) imports spader_pipeline.native.trainer: native.trainer is not "
        "below native.config"]


def test_the_circle_check_sees_a_circle_through_a_type_checking_import(tmp_path, monkeypatch):
    """The checker itself: the circle the training settings once had (the settings looked the backend
    up inside a function, the backends named the settings for type checkers) is found."""
    root = tmp_path / PACKAGE / "training"
    root.mkdir(parents=True)
    (root.parent / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .settings import TrainingSettings\n")
    (root / "settings.py").write_text("def check():\n    from spader_pipeline.training.backends import get\n")
    (root / "backends.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from spader_pipeline.training.settings import TrainingSettings\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path / PACKAGE)
    with pytest.raises(AssertionError, match="training.backends -> spader_pipeline.training.settings"):
        test_no_import_circle()
