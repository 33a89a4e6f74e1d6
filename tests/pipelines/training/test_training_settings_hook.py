"""``kedro run --params training.<typo>=…`` (which Kedro's CLI hands to the session as nested runtime
parameters): the run stops as it starts, naming the key, before its MLflow run, the fork server or
any node (so before any child process)."""

from __future__ import annotations

import mlflow
import pytest
from kedro.framework.session import KedroSession

from spader_pipeline.typed_config import SettingsError


@pytest.mark.parametrize(("params", "message", "pipeline"), [
    ({"training": {"natvie_typo": 1}}, r"training.natvie_typo", "train_spader"),
    ({"training": {"native": {"total_stepz": 3}}}, r"training.native.total_stepz", "train_spader"),
    ({"training": {"backend": "tpu"}}, r"training.backend='tpu': use one of \['native', 'verl'\]", "train_spader"),
    ({"training": {"verl": {"ppo_epochz": 2}}},
     r"unknown training.verl settings \['ppo_epochz'\] \(training.verl.ppo_epochz\); known: \[.*'overrides'",
     "train_spader"),
    ({"warm_start": {"stepz": 5}}, r"unknown warm_start settings \['stepz'\] \(warm_start.stepz\); known: \[.*'sft'",
     "warm_start"),
    ({"warm_start": {"sft": {"max_stepz": 5}}},
     r"unknown warm_start.sft settings \['max_stepz'\] \(warm_start.sft.max_stepz\); known: \[.*'max_steps'",
     "warm_start"),
], ids=["unknown-top-level", "unknown-native", "bad-backend", "unknown-verl", "unknown-warm-start",
        "unknown-warm-start-sft"])
def test_a_bad_training_setting_stops_the_run_before_anything_starts(kedro_project, node_starts, monkeypatch,
                                                                     params, message, pipeline):
    import spader_pipeline.child_process as child_process

    started = []
    monkeypatch.setattr(child_process, "start_server", lambda: started.append(True) or True)
    runs_before = len(mlflow.search_runs(search_all_experiments=True, output_format="list"))
    with KedroSession.create(project_path=kedro_project, env="test", runtime_params=params) as session:
        session._hook_manager.register(node_starts)
        with pytest.raises(SettingsError, match=message):
            session.run(pipeline_names=[pipeline])
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
