"""The verl trainer-loop modules' shared workspace: one per module (a tiny model, a served index, parquet)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def workspace(request, tmp_path_factory):
    """:func:`verl_loop_support.trainer_loop_workspace` for the module (a module may define its own)."""
    pytest.importorskip("verl")
    from verl_loop_support import trainer_loop_workspace

    with trainer_loop_workspace(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])) as ws:
        yield ws
