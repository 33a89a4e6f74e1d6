"""verl's metrics on their way to the method's MLflow run: files, not calls to the server.

verl's MLflow tracker logs each step synchronously (a down server blocks it, then drops the step):
with a run to log into, verl's ``file`` tracker and our plugin's step metrics write local JSON lines
instead (:func:`metrics_to_files`), and :func:`following` ships their lines from the Kedro process
through a buffered writer while the launch runs (docs/reliability.md).

A verl run's MLflow run carries the native trainer's names too: our plugin logs the rollout's metrics
under them (``method_reward/*``, ``answer/*``, ``rollout/*``, ``adv/*``, ``group/*``, ``val/*``), and
:data:`NATIVE_NAMES` adds them for the terms of verl's update and its timings (verl's own names stay).
:func:`training_history` reads both files back as the per-step history the report draws.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from spader_pipeline.tracking.buffer import active_run_writer, finite_numbers
from spader_pipeline.tracking.metrics_files import METRICS_PATH_ENV, follow_jsonl, parse_metrics_line

#: verl's name of a term of its update or of a timing → the native trainer's name of the same quantity
#: (verl's PPO loss and aggregation on both: tests/verl_plugin/test_verl_native_parity.py)
NATIVE_NAMES = {
    "actor/pg_loss": "loss/policy",
    "actor/kl_loss": "loss/kl",
    "actor/entropy": "policy/entropy",
    "actor/pg_clipfrac": "policy/clipfrac",
    "actor/pg_clipfrac_lower": "policy/clipfrac_lower",
    "actor/ppo_kl": "policy/approx_kl",
    "actor/grad_norm": "optim/grad_norm",
    "actor/lr": "optim/lr",
    "timing_s/step": "perf/step_seconds",
    "timing_s/gen": "perf/rollout_seconds",
    "timing_s/update_actor": "perf/update_seconds",
    "timing_s/update_weights": "perf/weight_sync_seconds",
    "timing_s/old_log_prob": "perf/old_log_prob_seconds",
    "timing_s/ref": "perf/reference_seconds",
    "timing_s/testing": "perf/validation_seconds",
    # our plugin's search health, which verl files among its timings: failed searches / searches
    "timing_s/search/error_rate": "rollout/search_failed",
}
#: verl's name of a quantity it logs only on some paths → the native name, where the name of
#: :data:`NATIVE_NAMES` is not logged: the policy's mean token entropy is ``actor/entropy`` where verl
#: recomputes the old log-probs, and the update's ``actor/entropy_loss`` (the same mean, on the batch the
#: update trains on) where the rollout's serve as the old ones (``bypass_mode``, the CPU configurations)
NATIVE_FALLBACKS = {"actor/entropy_loss": "policy/entropy"}
#: the files a launch's metrics go to, in ``run_dir``: verl's tracker's, then our plugin's
METRICS_FILES = ("verl_metrics.jsonl", "step_metrics.jsonl")


def with_native_names(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` plus, for each verl name of :data:`NATIVE_NAMES` among them, the native name (and of
    :data:`NATIVE_FALLBACKS`, where that native name is not given otherwise)."""
    native = {NATIVE_NAMES[k]: v for k, v in metrics.items() if k in NATIVE_NAMES}
    fallbacks = {NATIVE_FALLBACKS[k]: v for k, v in metrics.items() if k in NATIVE_FALLBACKS}
    return {**metrics, **{k: v for k, v in fallbacks.items() if k not in native}, **native}


def metrics_to_files(params: dict[str, Any], env: dict[str, str], run_dir: Path) -> list[Path]:
    """verl's MLflow tracker logs each step synchronously (a down server blocks it, then drops the
    step): with a run to log into, verl's ``file`` tracker and our plugin's step metrics write local
    JSON lines instead, which :func:`following` ships through a buffered writer
    (docs/reliability.md). ``run_dir`` must be visible from the trainer's node, as for checkpoints."""
    if "mlflow" not in params["logger"]:
        return []
    params["logger"] = list(dict.fromkeys("file" if b == "mlflow" else b for b in params["logger"]))
    files = [(run_dir / name).resolve() for name in METRICS_FILES]
    env["VERL_FILE_LOGGER_PATH"], env[METRICS_PATH_ENV] = str(files[0]), str(files[1])
    return files


@contextlib.contextmanager
def following(files: Sequence[Path]) -> Iterator[None]:
    """While the body runs (the launch), send the lines appended to ``files`` to the active MLflow run.

    A previous launch's files are first kept aside under one time (``<name>.<time>.jsonl``: what
    :func:`training_history` reads as that launch's). When the launch ends, what the run's history keeps
    of the earlier launches (a resumed run's steps before the checkpoint it resumed from) goes to this
    run too, so that its MLflow run holds the whole history as the report reads it. Without an active
    run nothing is sent.
    """
    stamp = time.strftime(KEPT_ASIDE_TIME)
    for path in files:
        if path.exists():
            path.replace(path.with_name(f"{path.stem}.{stamp}.jsonl"))
    with active_run_writer() as writer:
        with follow_jsonl(files, writer, transform=with_native_names):
            yield
        if writer is not None and files:
            for step, row in earlier_launches_part(Path(files[0]).parent).items():
                writer.log_metrics(row, step)


def earlier_launches_part(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """Per step, the metrics of :func:`training_history` that the latest launch did not log (those
    of the earlier launches it keeps); empty for a run of one launch."""
    history, latest = _merged_launches(Path(run_dir))
    part = {}
    for step, row in sorted(history.items()):
        earlier = {k: v for k, v in row.items() if k not in latest.get(step, {})}
        if earlier:
            part[step] = earlier
    return part


def training_history(run_dir: str | Path) -> list[dict[str, float]]:
    """A finished verl run's per-step history under the native trainer's names (as the native trainer
    returns it, ``step`` in each row): its metrics files (:data:`METRICS_FILES`, or verl's
    ``metrics.jsonl`` where no MLflow run took them) merged by step: finite numbers, under the keys
    MLflow takes (verl's ``…/mean@1`` → ``…/mean_at_1``, as the run's own metrics).

    A run resumed from a checkpoint (verl's ``resume_mode: auto``) spans launches: the earlier launches'
    files, kept aside by :func:`following`, come first, and each later launch replaces the steps after
    its first logged one (the steps redone from the checkpoint) and adds to that step's row (a resumed
    launch validates the checkpoint it starts from under that step), as the native trainer keeps the
    history up to the step it resumes from."""
    history, _ = _merged_launches(Path(run_dir))
    return [{"step": step, **history[step]} for step in sorted(history)]


def _merged_launches(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """Per step, the run's history merged over its launches (:func:`training_history`'s rule), and the
    latest launch's own rows; each file read once."""
    history: dict[int, dict[str, float]] = {}
    steps: dict[int, dict[str, float]] = {}
    for files in _launches(run_dir):
        steps = _steps(files)
        if steps:
            first = min(steps)
            history = {step: row for step, row in history.items() if step <= first}
        for step, row in steps.items():
            history.setdefault(step, {}).update(row)
    return history, steps


#: the time in the names of an earlier launch's metrics files (``verl_metrics.20261129-083012.jsonl``)
KEPT_ASIDE_TIME = "%Y%m%d-%H%M%S"


def _launches(run_dir: Path) -> list[list[Path]]:
    """The metrics files of each launch of ``run_dir``, earliest first: those kept aside, by their time
    (names sort as times), then the current ones."""
    stems = [Path(name).stem for name in METRICS_FILES]
    stamps = sorted({stamp for stem in stems for path in run_dir.glob(f"{stem}.*.jsonl")
                     if _is_stamp(stamp := path.name[len(stem) + 1:-len(".jsonl")])})
    current = METRICS_FILES if (run_dir / METRICS_FILES[0]).is_file() else ("metrics.jsonl", METRICS_FILES[1])
    return [*([run_dir / f"{stem}.{stamp}.jsonl" for stem in stems] for stamp in stamps),
            [run_dir / name for name in current]]


def _is_stamp(text: str) -> bool:
    try:
        time.strptime(text, KEPT_ASIDE_TIME)
    except ValueError:
        return False
    return True


def _steps(files: Sequence[Path]) -> dict[int, dict[str, float]]:
    """One launch's ``files`` merged by step (finite numbers under the native names)."""
    steps: dict[int, dict[str, float]] = {}
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            parsed = parse_metrics_line(line)
            if parsed:
                metrics, step = parsed
                steps.setdefault(step, {}).update(finite_numbers(with_native_names(metrics)))
    return steps
