"""The analysis notebook is committed valid and with outputs stripped."""

from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "training_report.ipynb"


def test_notebook_is_valid_and_stripped():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    source = "\n".join(c.source for c in code)
    assert 'catalog.load("eval_table")' in source and "get_metric_history" in source
