"""Tables of the reports as markdown: one number format (3 decimals, whole numbers bare, NaN as –)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def format_value(value: Any) -> str:
    """A cell: floats to 3 decimals (whole numbers ≥ 1 bare, NaN as ``–``), anything else as text."""
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return str(int(value)) if value.is_integer() and abs(value) >= 1 else f"{value:.3f}"
    return str(value)


def markdown_table(frame: pd.DataFrame) -> str:
    """``frame`` as a markdown table (``_(no rows)_`` when empty)."""
    if frame.empty:
        return "_(no rows)_\n"
    header = "| " + " | ".join(frame.columns) + " |\n|" + "---|" * len(frame.columns) + "\n"
    body = "".join("| " + " | ".join(format_value(v) for v in row) + " |\n" for row in frame.itertuples(index=False))
    return header + body
