"""What a grid asks of Ray: the ``grid`` parameters typed (conf/base/parameters_grid.yml), and the
resources each job declares, worked out against the nodes Ray reports.

A cell's ``num_cpus: null`` is its share of the largest node: that node's CPUs over the cells that fit
on it at once (by ``memory_gib`` against the node's memory, by ``num_gpus``, and never more than there
are cells). On 2 cores and 24 GB, 4 cells of 5 GiB each get half a CPU and run at once, one torch thread
each, as ``make positive-control``'s four one-thread jobs did before the grid ran on Ray. The shared
part's ``num_cpus: null`` is the whole largest node. A job's torch threads are its CPUs, at least one.

Cells of another kind ask for their own resources: ``grid.cells`` maps a pattern of cell names
(``fnmatch``: ``fit_*_verl_*``) to the resources of the cells it matches, the first match winning;
every other cell asks for ``grid.cell``. Each kind's ``num_cpus: null`` is its share of the largest
node among the cells of that kind (:meth:`GridSettings.cell_groups`): a verl cell of
``make positive-control-verl`` holds an FSDP actor, a rollout server and their Ray, and asks for
the whole machine where the native cells share it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spader_pipeline.typed_config import from_mapping, typed_block

GIB = 2**30


@dataclass(frozen=True)
class Resources:
    """One job's Ray resources (``@ray.remote``'s ``num_cpus``, ``num_gpus``, ``memory``)."""

    num_cpus: float | None = None
    """CPUs; ``null``: a share of the largest node (see the module)"""
    num_gpus: float = 0.0
    memory_gib: float = 0.0
    """memory the job needs at its peak, reserved in Ray's logical ``memory`` resource (0: none)"""

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus", "memory_gib"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value}: use a number ≥ 0")
        if self.num_cpus == 0:
            raise ValueError("num_cpus=0: a job needs some CPU (null: a share of the largest node)")


@dataclass(frozen=True)
class GridSettings:
    """The ``grid`` block: where the grid runs and what each job asks for."""

    ray_address: str | None = None
    """a Ray cluster's address; ``null``: ``RAY_ADDRESS``, else a Ray started for this grid alone"""
    max_retries: int = 3
    """times Ray runs a job again whose worker or node died (it resumes from its last checkpoint)"""
    cell: Resources = field(default_factory=Resources)
    shared: Resources = field(default_factory=Resources)
    cells: Mapping[str, Resources] = field(default_factory=dict)
    """a pattern of cell names (``fnmatch``) → the resources of the cells it matches (the first match, in
    order); a cell no pattern matches asks for ``cell``"""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> GridSettings:
        values = dict(params or {})
        for part in ("cell", "shared"):
            values[part] = typed_block(f"grid.{part}", lambda part=part: from_mapping(
                Resources, values.get(part), where=f"grid.{part}", check_types=True))
        values["cells"] = {str(pattern): typed_block(f"grid.cells.{pattern}", lambda p=pattern, v=block: from_mapping(
            Resources, v, where=f"grid.cells.{p}", check_types=True)) for pattern, block in (values.get("cells") or {}).items()}
        settings = from_mapping(cls, values, where="grid", check_types=True)
        if settings.max_retries < 0:
            raise ValueError(f"grid.max_retries={settings.max_retries}: use 0 or more")
        return settings

    def pattern_of(self, cell: str) -> str | None:
        """The first pattern of ``cells`` that ``cell`` matches; ``None``: it asks for ``cell``."""
        return next((pattern for pattern in self.cells if fnmatch.fnmatchcase(cell, pattern)), None)

    def resources_for(self, cell: str) -> Resources:
        """The resources ``cell`` asks for: its pattern's in ``cells``, else ``cell``."""
        pattern = self.pattern_of(cell)
        return self.cell if pattern is None else self.cells[pattern]

    def cell_groups(self, cells: Sequence[str]) -> list[tuple[Resources, list[str]]]:
        """``cells`` grouped by the resources they ask for (their pattern), each group in the order of
        ``cells``, the groups in the order of their first cells."""
        groups: dict[str | None, list[str]] = {}
        for cell in cells:
            groups.setdefault(self.pattern_of(cell), []).append(cell)
        return [(self.cell if pattern is None else self.cells[pattern], members) for pattern, members in groups.items()]


@dataclass(frozen=True)
class Node:
    """What Ray reports of one node: its CPUs, GPUs and logical memory (bytes)."""

    cpus: float
    gpus: float = 0.0
    memory: float = 0.0

    @classmethod
    def from_ray(cls, resources: Mapping[str, float]) -> Node:
        return cls(float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0)), float(resources.get("memory", 0.0)))


@dataclass(frozen=True)
class JobOptions:
    """The options of one job's Ray task and its thread count."""

    num_cpus: float
    num_gpus: float
    memory: int
    """bytes"""
    threads: int

    def ray_options(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **({"memory": self.memory} if self.memory else {})}


def _largest(nodes: Sequence[Node]) -> Node:
    if not nodes:
        raise ValueError("Ray reports no live node")
    return max(nodes, key=lambda n: (n.cpus, n.memory))


def _options(cpus: float, resources: Resources, node: Node | None = None) -> JobOptions:
    # never more memory than the largest node has: a job that asks for more would wait forever (Ray's
    # memory is what was free when it started); asking for all of it, it runs there alone
    memory = int(resources.memory_gib * GIB)
    if node is not None and node.memory:
        memory = min(memory, int(node.memory))
    return JobOptions(num_cpus=cpus, num_gpus=resources.num_gpus, memory=memory, threads=max(1, math.floor(cpus + 1e-9)))


def cell_options(resources: Resources, nodes: Sequence[Node], cells: int) -> JobOptions:
    """A cell's options: ``resources``, with ``num_cpus: null`` made the cell's share of the largest node,
    and its memory at most that node's."""
    node = _largest(nodes)
    if resources.num_cpus is not None:
        return _options(resources.num_cpus, resources, node)
    fit = max(1, cells)
    if resources.memory_gib and node.memory:
        fit = min(fit, int(node.memory // (resources.memory_gib * GIB)))
    if resources.num_gpus:
        fit = min(fit, int(node.gpus // resources.num_gpus))
    fit = max(1, fit)
    share = node.cpus / fit
    # Ray takes fractions of one CPU (to 1e-4) or whole CPUs
    cpus = math.floor(share) if share >= 1 else math.floor(share * 10_000) / 10_000
    return _options(max(cpus, 1e-4), resources, node)


def shared_options(resources: Resources, nodes: Sequence[Node]) -> JobOptions:
    """The shared part's options: ``resources``, with ``num_cpus: null`` made every CPU of the largest node,
    and its memory at most that node's."""
    node = _largest(nodes)
    cpus = resources.num_cpus if resources.num_cpus is not None else max(1.0, math.floor(node.cpus))
    return _options(cpus, resources, node)
