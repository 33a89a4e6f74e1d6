"""``kedro run --env <env> --pipeline compare`` builds the cells of ``<env>``'s ``compare.methods`` ×
``compare.seeds``; a registry built from other parameters stops the run before anything starts."""

from __future__ import annotations

import mlflow
import pytest
from kedro.framework.session import KedroSession
from kedro.runner import SequentialRunner

FOUR_SEEDS = [f"{m}_seed{s}" for s in range(4) for m in ("grpo", "spader")]


class Recorded(SequentialRunner):
    """Records the pipeline it is given; runs no node."""

    def __init__(self) -> None:
        super().__init__()
        self.pipeline = None

    def run(self, pipeline, catalog, hook_manager=None, run_id=None, only_missing_outputs=False):
        self.pipeline = pipeline
        return {}


def _run(project, env: str, **run_args) -> Recorded:
    runner = Recorded()
    with KedroSession.create(project_path=project, env=env) as session:
        session.run(pipeline_names=["compare"], runner=runner, **run_args)
    return runner


def _cells(pipeline) -> list[str]:
    return sorted({n.namespace for n in pipeline.nodes if n.namespace})


@pytest.fixture
def four_seeds(kedro_project):
    """An environment of 4 seeds, beside conf/base's 3."""
    env = kedro_project / "conf" / "four_seeds"
    env.mkdir()
    (env / "parameters_compare.yml").write_text("compare:\n  seeds: [0, 1, 2, 3]\n")
    return kedro_project


def test_the_run_environment_decides_the_cells(four_seeds, monkeypatch):
    monkeypatch.delenv("KEDRO_ENV", raising=False)
    ran = _run(four_seeds, "four_seeds")
    assert _cells(ran.pipeline) == sorted(FOUR_SEEDS)
    (design,) = [n for n in ran.pipeline.nodes if n.name == "check_compare_design"]
    assert sorted(design.func.keywords["cells"]) == sorted((m, s) for s in range(4) for m in ("grpo", "spader"))
    assert {f"{c}__samples" for c in FOUR_SEEDS} <= set(ran.pipeline.inputs()) | set(ran.pipeline.all_outputs())
    # one of the environment's own cells runs alone
    assert _cells(_run(four_seeds, "four_seeds", namespaces=["spader_seed3"]).pipeline) == ["spader_seed3"]


def test_a_registry_built_from_other_parameters_stops_the_run_before_anything_starts(four_seeds):
    _run(four_seeds, "four_seeds")  # this process's registry now holds the 4-seed cells
    runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
    with pytest.raises(ValueError) as mismatch:
        _run(four_seeds, "test")  # conf/test keeps conf/base's 3 seeds
    message = str(mismatch.value)
    assert "env 'test'" in message and "[0, 1, 2]" in message and "spader_seed3" in message
    assert "conf/test/parameters_compare.yml" in message and "new process" in message
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == runs_before
    assert not (four_seeds / "data" / ".kedro-run.lock").exists()
