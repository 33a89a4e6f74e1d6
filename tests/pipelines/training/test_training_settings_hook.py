"""``kedro run --params training.<typo>=…`` (which Kedro's CLI hands to the session as nested runtime
parameters): the run stops as it starts, naming the key, before its MLflow run, the fork server or
any node (so before any child process)."""

from __future__ import annotations

import mlflow
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.typed_config import SettingsError


@pytest.mark.parametrize(("params", "message"), [
    ({"training": {"natvie_typo": 1}}, r"training.natvie_typo"),
    ({"training": {"native": {"total_stepz": 3}}}, r"training.native.total_stepz"),
    ({"training": {"backend": "tpu"}}, r"training.backend='tpu': use one of \['native', 'verl'\]"),
], ids=["unknown-top-level", "unknown-native", "bad-backend"])
def test_a_bad_training_setting_stops_the_run_before_anything_starts(kedro_project, node_starts, monkeypatch,
                                                                     params, message):
    import spader_pipeline.child_process as child_process

    started = []
    monkeypatch.setattr(child_process, "start_server", lambda: started.append(True) or True)
    runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=params) as session:
        session._hook_manager.register(node_starts)
        with pytest.raises(SettingsError, match=message):
            session.run(pipeline_names=["train_spader"])
    assert node_starts.names == [] and started == []
    assert len(mlflow.search_runs(search_all_experiments=True, output_format="list")) == runs_before
    assert not (kedro_project / "data" / ".kedro-run.lock").exists()


def test_the_default_chain_stops_before_the_warm_start(kedro_project, node_starts):
    """The warm start reads no ``training``, but the run reads it later: it stops before the first node."""
    with KedroSession.create(project_path=kedro_project, env="test",
                             runtime_params={"training": {"validation": {"evry": 2}}}) as session:
        session._hook_manager.register(node_starts)
        with pytest.raises(SettingsError, match=r"training.validation.evry"):
            session.run()
    assert node_starts.names == []
