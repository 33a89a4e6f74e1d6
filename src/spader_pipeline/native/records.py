"""What a native run writes beside its checkpoints: the metrics history and sampled trajectories.

``metrics.jsonl`` holds one line per finished step (a resumed run cuts it back to its checkpoint);
``samples/step_<n>.json`` a few trajectories of a step with their returns, for reading by eye.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def history_path(run_dir: Path) -> Path:
    return run_dir / "metrics.jsonl"


def read_history(run_dir: Path) -> list[dict[str, float]]:
    """The steps recorded so far (a line cut by a crash is skipped)."""
    path = history_path(run_dir)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def write_history(run_dir: Path, history: list[dict[str, float]]) -> None:
    history_path(run_dir).write_text("".join(json.dumps(h) + "\n" for h in history))


def append_history(run_dir: Path, row: dict[str, float]) -> None:
    with history_path(run_dir).open("a") as f:
        f.write(json.dumps(row) + "\n")


def write_samples(run_dir: Path, step: int, trajectories: list[Any], returns: list[float], k: int) -> Path:
    """The first ``k`` trajectories of ``step`` with their returns, as ``samples/step_<step>.json``."""
    path = run_dir / "samples" / f"step_{step:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for t, ret in list(zip(trajectories, returns, strict=True))[:k]:
        records.append({
            "id": t.id, "question": t.question, "return": ret, "finish_reason": t.finish_reason,
            "predicted": list(t.predicted) if t.predicted is not None else None, "messages": t.messages[1:],
        })
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False))
    return path
