"""Imports only point down: every module of ``spader_pipeline`` imports from its own package or from
a lower layer, never from a higher one (nor from a sibling of its own layer).

The order below is the one place it is written. Why each layer sits where it does:

* leaves: the package root (``__version__``), strict typed settings, local-server helpers
  (ports, processes), the data-root lock and the host-memory helpers; standard library and
  third-party code only;
* over the leaves: ``child_process``, which bounds its children's heap with ``host_memory``; and
  ``tracking``, MLflow (the store, the runs and what is logged into them, the buffered writer, the
  UI server) for every layer above that logs: the trainers and the verl plugin as well as the Kedro
  shell; then ``tracking_buffer``, the buffered writer's old import path (a re-export);
* core: the methods' maths (``algorithms``) and the models (``modeling``), pure torch/numpy;
* ``retrieval``: indexes, the search service and its client;
* ``agent``: the search agent's protocol, prompts and rollouts, over retrieval's schemas and the models;
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
* the Kedro shell: ``pipelines`` (thin nodes), then ``hooks``, which read the compare pipeline's cells; then Kedro's entry points.

Imports inside functions and ``if TYPE_CHECKING:`` blocks count as well; relative imports are
resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "spader_pipeline"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

#: bottom first; a module may import its own top-level package and those of lower layers
LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "typed_config", "local_servers", "run_lock", "host_memory", "bf16_switch"),
    ("child_process", "tracking"),
    ("tracking_buffer",),
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
    ("settings", "pipeline_registry", "__main__"),
)
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


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
