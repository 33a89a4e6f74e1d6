"""Provenance of a run: which source it ran from (recorded as the chain run's ``git.commit`` tag)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(project_path: Path) -> str:
    """The current git commit of the project (``"unknown"`` outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=project_path, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
