"""Row-level validation of unified QA tables with great-expectations, and the quarantine.

Every row either passes or is quarantined with the list of rules it broke; nothing is dropped
silently. Rules (one great-expectations expectation each, run in an ephemeral in-process context):

================  =====================================================================
reason            rule
================  =====================================================================
missing_id        ``id`` is present
duplicate_id      ``id`` is unique (the first occurrence is kept, later ones quarantined)
empty_question    ``question`` has at least one non-blank character
question_too_long ``question`` is at most ``max_question_chars`` characters
bad_ground_truth  ``ground_truth`` is a list of lists of strings
no_answers        at least one entity
empty_alias       every entity has at least one non-empty surface form
unmatchable_alias every entity has a surface form that survives answer normalisation
                  (``"The"`` or ``"!!!"`` normalise to nothing and could never be matched)
unknown_split     ``split`` is one of train / validation / test
invalid_json      the input line is not JSON (set by the reader; the raw line is the record,
                  no other rule runs)
not_an_object     the input item is JSON but not an object (likewise)
================  =====================================================================

A table whose quarantine rate exceeds ``max_failure_rate`` stops the pipeline
(:func:`enforce_quality_gate`) after the quarantine has been written, so the bad rows can be
inspected.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from spader_pipeline.algorithms.matching import normalize_answer
from spader_pipeline.data.schema import PARSE_ERROR, RAW_RECORD, SPLITS, UNIFIED_COLUMNS

logger = logging.getLogger(__name__)

QUARANTINE_COLUMNS = ("id", "data_source", "split", "reasons", "record")


class DataQualityError(RuntimeError):
    """A dataset's quarantine rate is above the configured threshold."""


@dataclass(frozen=True)
class ValidationOutcome:
    clean: pd.DataFrame
    quarantine: pd.DataFrame
    metrics: dict[str, Any]


def _is_entity_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(entity, list) and all(isinstance(form, str) for form in entity) for entity in value
    )


def _surface_forms(entity: Any) -> list[str]:
    """An entity's non-blank string surface forms (none when the entity is not a list)."""
    if not isinstance(entity, list):
        return []
    return [form for form in entity if isinstance(form, str) and form.strip()]


def _check_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Derived, flat columns that expectations can test (one row per input row, same order)."""
    records = []
    for row in rows:
        truth = row.get("ground_truth")
        entities = truth if isinstance(truth, list) else []
        forms = [_surface_forms(entity) for entity in entities]
        well_formed = _is_entity_list(truth)
        question = row.get("question")
        records.append(
            {
                "id": row.get("id") if isinstance(row.get("id"), str) and row.get("id") else None,
                "question_chars": len(question.strip()) if isinstance(question, str) else 0,
                "ground_truth_ok": well_formed,
                "num_entities": len(entities),
                "empty_entities": sum(1 for f in forms if not f),
                "unmatchable_entities": sum(
                    1 for f in forms if f and not any(normalize_answer(form) for form in f)
                )
                if well_formed
                else 0,
                # Expectations skip nulls, so a missing split is made a visible non-member value.
                "split": row.get("split") if isinstance(row.get("split"), str) else "<missing>",
            }
        )
    return pd.DataFrame.from_records(
        records,
        columns=["id", "question_chars", "ground_truth_ok", "num_entities", "empty_entities",
                 "unmatchable_entities", "split"],
    )


def _expectations(max_question_chars: int):
    import great_expectations as gx

    expect = gx.expectations
    return {
        "missing_id": expect.ExpectColumnValuesToNotBeNull(column="id"),
        "duplicate_id": expect.ExpectColumnValuesToBeUnique(column="id"),
        "empty_question": expect.ExpectColumnValuesToBeBetween(column="question_chars", min_value=1),
        "question_too_long": expect.ExpectColumnValuesToBeBetween(
            column="question_chars", max_value=max_question_chars
        ),
        "bad_ground_truth": expect.ExpectColumnValuesToBeInSet(column="ground_truth_ok", value_set=[True]),
        "no_answers": expect.ExpectColumnValuesToBeBetween(column="num_entities", min_value=1),
        "empty_alias": expect.ExpectColumnValuesToBeBetween(column="empty_entities", max_value=0),
        "unmatchable_alias": expect.ExpectColumnValuesToBeBetween(column="unmatchable_entities", max_value=0),
        "unknown_split": expect.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS)),
    }


class QAValidator:
    """One great-expectations suite, reused for every table (ephemeral context, no files written)."""

    def __init__(self, max_question_chars: int = 2000) -> None:
        os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
        import great_expectations as gx

        self._context = gx.get_context(mode="ephemeral")
        self._context.variables.progress_bars = {"globally": False}
        asset = self._context.data_sources.add_pandas("qa").add_dataframe_asset("rows")
        self._batch_definition = asset.add_batch_definition_whole_dataframe("whole_table")
        self._reasons: dict[str, str] = {}
        suite = gx.ExpectationSuite(name="unified_qa")
        for reason, expectation in _expectations(max_question_chars).items():
            suite.add_expectation(expectation)
            self._reasons[self._key(expectation)] = reason
        self._suite = self._context.suites.add(suite)

    @staticmethod
    def _key(expectation) -> str:
        config = expectation.configuration if hasattr(expectation, "configuration") else expectation
        kwargs = {k: v for k, v in config.kwargs.items() if k in ("column", "min_value", "max_value")}
        return f"{config.type}:{json.dumps(kwargs, sort_keys=True, default=str)}"

    def row_reasons(self, rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
        """For each row, the reasons it fails (empty list: the row is clean)."""
        reasons: list[list[str]] = [[] for _ in rows]
        if not rows:
            return reasons
        checks = _check_frame(rows)
        batch = self._batch_definition.get_batch(batch_parameters={"dataframe": checks})
        result = batch.validate(self._suite, result_format={"result_format": "COMPLETE"})
        for expectation_result in result.results:
            reason = self._reasons[self._key(expectation_result.expectation_config)]
            for index in expectation_result.result.get("unexpected_index_list") or []:
                reasons[int(index)].append(reason)
        # The uniqueness rule flags every copy; keep the first occurrence of each id.
        first_seen: set[str] = set()
        for index, row_id in enumerate(checks["id"]):
            if "duplicate_id" in reasons[index] and row_id not in first_seen:
                reasons[index].remove("duplicate_id")
            if row_id is not None:
                first_seen.add(row_id)
        return reasons


def _unified(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row without the reader's parse-error keys."""
    return {k: v for k, v in row.items() if k not in (PARSE_ERROR, RAW_RECORD)}


def _answer_stats(clean: pd.DataFrame) -> dict[str, float]:
    if clean.empty:
        return {"answers_per_question_mean": 0.0, "answers_per_question_median": 0.0,
                "answers_per_question_max": 0.0, "multi_answer_questions": 0.0}
    counts = clean["ground_truth"].map(len)
    return {
        "answers_per_question_mean": float(counts.mean()),
        "answers_per_question_median": float(counts.median()),
        "answers_per_question_max": float(counts.max()),
        "multi_answer_questions": float((counts >= 2).sum()),
    }


def validate_tables(
    tables: Mapping[str, Sequence[Mapping[str, Any]]], max_question_chars: int = 2000
) -> ValidationOutcome:
    """Validate each named table (e.g. one per data source) and split rows into clean/quarantine.

    Returns the clean rows (unified columns), the quarantined rows (``id, data_source, split,
    reasons, record``: the reasons joined by ``;`` and the original record as JSON), and metrics
    per table: rows in, clean, quarantined, quarantine rate, count per reason, answers per question.
    """
    validator = QAValidator(max_question_chars)
    clean_rows: list[Mapping[str, Any]] = []
    quarantined: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {}
    for name, rows in tables.items():
        unreadable = [isinstance(row.get(PARSE_ERROR), str) for row in rows]
        readable = [row for row, bad in zip(rows, unreadable, strict=True) if not bad]
        checked = iter(validator.row_reasons(readable))
        reasons = [[row[PARSE_ERROR]] if bad else next(checked) for row, bad in zip(rows, unreadable, strict=True)]
        table_clean = [_unified(row) for row, why in zip(rows, reasons, strict=True) if not why]
        table_bad = [(row, why) for row, why in zip(rows, reasons, strict=True) if why]
        for row, why in table_bad:
            raw = row.get(RAW_RECORD) if isinstance(row.get(PARSE_ERROR), str) else None
            quarantined.append(
                {
                    "id": str(row.get("id")),
                    "data_source": str(row.get("data_source", name)),
                    "split": str(row.get("split")),
                    "reasons": ";".join(why),
                    "record": raw if raw is not None else json.dumps(_unified(row), ensure_ascii=False, default=str),
                }
            )
        clean_rows.extend(table_clean)
        reason_counts = Counter(reason for _, why in table_bad for reason in why)
        table_frame = pd.DataFrame.from_records(table_clean, columns=list(UNIFIED_COLUMNS))
        metrics[name] = {
            "rows_in": len(rows),
            "rows_clean": len(table_clean),
            "rows_quarantined": len(table_bad),
            "quarantine_rate": len(table_bad) / len(rows) if rows else 0.0,
            "quarantined": dict(reason_counts),
            **_answer_stats(table_frame),
        }
        if table_bad:
            logger.warning("%s: quarantined %d of %d rows (%s)", name, len(table_bad), len(rows), dict(reason_counts))
    clean = pd.DataFrame.from_records(clean_rows, columns=list(UNIFIED_COLUMNS))
    metrics["total"] = {
        "rows_in": sum(m["rows_in"] for m in metrics.values()),
        "rows_clean": len(clean),
        "rows_quarantined": len(quarantined),
    }
    quarantine = pd.DataFrame.from_records(quarantined, columns=list(QUARANTINE_COLUMNS))
    return ValidationOutcome(clean=clean, quarantine=quarantine, metrics=metrics)


def enforce_quality_gate(metrics: Mapping[str, Any], max_failure_rate: float) -> None:
    """Raise :class:`DataQualityError` naming every table whose quarantine rate is too high."""
    failing = {
        name: table
        for name, table in metrics.items()
        if name != "total" and table.get("rows_in") and table["quarantine_rate"] > max_failure_rate
    }
    if failing:
        details = "; ".join(
            f"{name}: {t['rows_quarantined']}/{t['rows_in']} rows quarantined "
            f"({t['quarantine_rate']:.1%} > {max_failure_rate:.1%}), reasons {t['quarantined']}"
            for name, t in failing.items()
        )
        raise DataQualityError(
            f"data quality gate failed — {details}. The quarantined rows and their reasons are in the "
            "`qa_quarantine` dataset; fix the source or raise data_prep.validation.max_failure_rate."
        )


def quarantine_report(metrics: Mapping[str, Any], quarantine: pd.DataFrame, examples: int = 5) -> str:
    """A markdown summary: per data source rows in/clean/quarantined and counts per reason, then a
    few quarantined ids per reason (the full rows are in the ``qa_quarantine`` dataset)."""
    lines = [
        "# Data quality report",
        "",
        "| data source | rows in | clean | quarantined | rate | reasons |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, table in metrics.items():
        if name == "total":
            continue
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(table["quarantined"].items())) or "-"
        lines.append(
            f"| {name} | {table['rows_in']} | {table['rows_clean']} | {table['rows_quarantined']} "
            f"| {table['quarantine_rate']:.1%} | {reasons} |"
        )
    total = metrics.get("total", {})
    lines += ["", f"Total: {total.get('rows_in', 0)} rows in, {total.get('rows_clean', 0)} clean, "
              f"{total.get('rows_quarantined', 0)} quarantined."]
    if not quarantine.empty:
        lines += ["", "## Examples", ""]
        exploded = quarantine.assign(reason=quarantine["reasons"].str.split(";")).explode("reason")
        for reason, group in exploded.groupby("reason", sort=True):
            ids = ", ".join(f"`{i}`" for i in group["id"].head(examples))
            lines.append(f"- **{reason}** ({len(group)}): {ids}")
    return "\n".join(lines) + "\n"
