"""Guards of a VERL run: a dead retrieval service stops it, padded rows stay out of the group terms,
and a node without the plugin is reported before training."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402

from spader_pipeline.verl_plugin.batch_reward import (  # noqa: E402
    SearchServiceError,
    _max_error_rate,
    check_search_health,
    original_rows,
    search_health,
)

ROOT = Path(__file__).resolve().parents[2]


def _generated(calls, errors) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": np.zeros((len(calls), 1))},
        non_tensors={"search_calls": np.array(calls, dtype=object), "search_errors": np.array(errors, dtype=object)},
    )


def test_original_rows_marks_verl_padding_copies():
    # 2 prompts x 3 rollouts, padded by verl with copies of the first 2 rows
    uid = ["a", "a", "a", "b", "b", "b", "a", "a"]
    assert original_rows(uid, 3).tolist() == [True] * 6 + [False, False]
    assert original_rows(uid, 8).all()


def test_search_error_rate_and_threshold():
    health = search_health(_generated([2, 1, 0, 1], [2, 0, 0, 1]))
    assert health == {"search/calls": 4.0, "search/error_rate": 0.75}
    with pytest.raises(SearchServiceError, match="75% of 4 searches"):
        check_search_health(health, 0.5)
    check_search_health(health, 0.8)
    check_search_health({"search/calls": 0.0, "search/error_rate": 0.0}, 0.0)  # no search, no verdict
    # padded copies are not counted
    keep = np.array([True, True, True, False])
    assert search_health(_generated([2, 1, 0, 1], [2, 0, 0, 1]), keep)["search/error_rate"] == pytest.approx(2 / 3)
    assert search_health(DataProto.from_dict(tensors={"x": np.zeros((1, 1))})) == {}


def test_threshold_is_read_from_the_search_tool_config(tmp_path):
    tool_config = ROOT / "conf/base/verl/tool_config/search_tool.yaml"
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"multi_turn": {"tool_config_path": str(tool_config)}}}})
    assert _max_error_rate(config) == 0.5
    custom = tmp_path / "tools.yaml"
    custom.write_text(tool_config.read_text().replace("max_error_rate: 0.5", "max_error_rate: 0.1"))
    config.actor_rollout_ref.rollout.multi_turn.tool_config_path = str(custom)
    assert _max_error_rate(config) == 0.1


def _missing_in_fresh_process(**env) -> str:
    """What a fresh worker process lacks, as printed text: the check arrives pickled by value, as
    Ray ships it, so the worker imports verl (and its plugins) the way Ray workers do."""
    from ray import cloudpickle

    from spader_pipeline.verl_plugin import registration

    cloudpickle.register_pickle_by_value(registration)
    try:
        payload = cloudpickle.dumps(partial(registration.missing_registrations, registration.required_registrations()))
    finally:
        cloudpickle.unregister_pickle_by_value(registration)
    code = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())())"
    base = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    out = subprocess.run([sys.executable, "-c", code], input=payload, env={**base, **env}, capture_output=True,
                         timeout=600, check=True)
    return out.stdout.decode().strip().splitlines()[-1]


@pytest.mark.slow
def test_registration_check_sees_a_worker_without_the_plugin():
    """A worker that loads no plugin (entry points off, module not forwarded) is reported by name.
    (The same check passes in every Ray worker of test_verl_trainer_loop.py, whose workers get the
    plugin only through the launcher's VERL_USE_EXTERNAL_MODULES.)"""
    missing = _missing_in_fresh_process(VERL_USE_EXTERNAL_PLUGINS="none")
    assert "'spa'" in missing and "'spader_search'" in missing and "'spader'" in missing


def test_registration_report_names_node_and_cause():
    from spader_pipeline.verl_plugin.registration import format_reports

    text = format_reports({"n1": {"host": "gpu7", "missing": {"agent loop": ["spader_search"]},
                                  "import_error": "ModuleNotFoundError: No module named 'spader_pipeline'",
                                  "VERL_USE_EXTERNAL_MODULES": ""}})
    assert "node n1 (gpu7): missing agent loop: spader_search" in text and "ModuleNotFoundError" in text
