"""The grids of ``make compare`` and ``make positive-control`` on Ray (docs/compare.md, "On Ray").

A grid is a registered Kedro pipeline with cells (namespaces tagged ``cell``, one per method × seed):
:mod:`.phases` reads it as shared part, cells and report; :mod:`.settings` types the ``grid``
parameters and works out each job's resources; :mod:`.tasks` is the Ray task that runs one job's
``kedro run`` (:mod:`.child`: in a process that dies with its worker); :mod:`.driver` runs the whole
grid and its MLflow run. ``python -m spader_pipeline.grid --env compare --pipeline compare`` runs it.

Nothing is imported here: a Ray worker imports :mod:`.tasks` alone.
"""
