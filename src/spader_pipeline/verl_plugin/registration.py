"""Check that every Ray node registers the project's verl plugin — before training starts.

verl imports plugins on ``import verl`` (``VERL_USE_EXTERNAL_MODULES`` and the ``verl.plugins`` entry
points) and logs entry-point import errors at debug level only, so a node where the plugin does not
load (package missing, environment variable not forwarded to a pre-started cluster) fails late or
not at all. :func:`check_workers_registered` runs one Ray task per alive node that imports verl
*the way verl's own workers do* and reports what is missing.

The task must reach the worker without importing this package (importing it registers everything
and would make the check pass trivially), so the module is pickled by value
(``cloudpickle.register_pickle_by_value``): the worker runs the functions below without importing
:mod:`spader_pipeline` until :func:`_node_report` looks for the reason of a failure.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence


def required_registrations() -> dict[str, tuple[str, ...]]:
    """What the project's verl runs need, by verl registry: every registered method's estimator
    (from :mod:`spader_pipeline.algorithms.methods`, so a new method is checked too), the agent loop
    and the reward manager. Called in the driver; the workers get the result as an argument."""
    from spader_pipeline.algorithms.methods import estimator_names

    return {"advantage estimator": estimator_names(), "agent loop": ("spader_search",),
            "reward manager": ("spader",)}


class PluginNotRegisteredError(RuntimeError):
    """The project's verl plugin is not registered in some Ray worker process."""


def missing_registrations(required: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Names of ``required`` (:func:`required_registrations`) not registered after ``import verl``
    in this process."""
    import verl  # noqa: F401  (runs verl's plugin loading)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    present = {"advantage estimator": ADV_ESTIMATOR_REGISTRY, "agent loop": _agent_loop_registry,
               "reward manager": REWARD_MANAGER}
    missing = {kind: [n for n in names if n not in present[kind]] for kind, names in required.items()}
    return {kind: names for kind, names in missing.items() if names}


def _node_report(required: Mapping[str, Sequence[str]]) -> dict:
    """Run on a worker: what is missing, and why the plugin did not load (if it does not)."""
    report = {"host": socket.gethostname(), "missing": missing_registrations(required),
              "VERL_USE_EXTERNAL_MODULES": os.environ.get("VERL_USE_EXTERNAL_MODULES", "")}
    if report["missing"]:
        try:
            import spader_pipeline.verl_plugin  # noqa: F401
        except Exception as exc:  # the reason verl swallowed
            report["import_error"] = f"{exc.__class__.__name__}: {exc}"
    return report


def format_reports(reports: Mapping[str, Mapping]) -> str:
    lines = []
    for node, report in reports.items():
        missing = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in report["missing"].items())
        line = f"node {node} ({report.get('host', '?')}): missing {missing}"
        if report.get("import_error"):
            line += f"; importing spader_pipeline.verl_plugin fails with {report['import_error']}"
        lines.append(line + f"; VERL_USE_EXTERNAL_MODULES={report.get('VERL_USE_EXTERNAL_MODULES')!r}")
    return "\n".join(lines)


def check_workers_registered(timeout: float = 300.0) -> None:
    """Raise :class:`PluginNotRegisteredError` unless the plugin registers on every alive Ray node with CPUs.

    Uses the running Ray session (call it from inside a verl run, e.g. the agent-loop manager).
    """
    import ray
    from ray import cloudpickle
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    required = required_registrations()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    task = ray.remote(num_cpus=0)(_node_report)
    # the nodes verl places its agent-loop workers on (AgentLoopManager._init_agent_loop_workers)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    refs = {node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(required)
            for node in nodes}
    reports = {}
    for node, ref in refs.items():
        try:
            reports[node] = ray.get(ref, timeout=timeout)
        except Exception as exc:  # e.g. spader_pipeline not installed there: the task cannot unpickle
            reports[node] = {"missing": required, "import_error": f"{exc.__class__.__name__}: {exc}"}
    bad = {node: r for node, r in reports.items() if r["missing"]}
    if bad:
        raise PluginNotRegisteredError(
            "the project's verl plugin is not registered on every Ray node; install spader-pipeline on "
            "each node and forward VERL_USE_EXTERNAL_MODULES=spader_pipeline.verl_plugin (the launcher "
            "sets ray_kwargs.ray_init.runtime_env.env_vars):\n" + format_reports(bad)
        )
