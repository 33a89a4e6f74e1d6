"""Fixtures for the Kedro pipeline tests."""

from __future__ import annotations

import pytest
from kedro.framework.hooks import hook_impl


class NodeStarts:
    """A Kedro hook: the run's node names as they start, in order (register it on a session's hook
    manager); a test may append its own events to :attr:`names` to see where they fall."""

    def __init__(self) -> None:
        self.names: list[str] = []

    @hook_impl
    def before_node_run(self, node) -> None:
        self.names.append(node.name)


@pytest.fixture
def node_starts() -> NodeStarts:
    return NodeStarts()
