"""Output formats of data_prep: evaluation jsonl and VERL training parquet rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from spader_pipeline.agent.prompts import render_prompt
from spader_pipeline.data.schema import SampleRecord, ground_truth_lists, sample_record

EVAL_FIELDS = ("id", "question", "ground_truth", "data_source")


def eval_partitions(qa: pd.DataFrame, splits: Sequence[str]) -> dict[str, pd.DataFrame]:
    """One evaluation table per ``<data_source>_<split>`` (the reference harness' jsonl format)."""
    partitions: dict[str, pd.DataFrame] = {}
    selected = qa[qa["split"].isin(list(splits))]
    for (source, split), group in selected.groupby(["data_source", "split"], sort=True):
        table = group.loc[:, list(EVAL_FIELDS)].copy()
        table["ground_truth"] = table["ground_truth"].map(ground_truth_lists)
        partitions[f"{source}_{split}"] = table.reset_index(drop=True)
    return partitions


def verl_rows(
    qa: pd.DataFrame, split: str, template: str, agent_name: str, sources: Sequence[str] | None = None
) -> pd.DataFrame:
    """VERL ``RLHFDataset`` rows for one split.

    Columns: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
    (``{"style": "rule", "ground_truth": [[aliases], ...]}``), ``extra_info`` (``index``, ``id``,
    ``split``, ``question``) and ``agent_name`` (selects our agent loop in VERL).
    """
    selected = qa[qa["split"] == split]
    if sources:
        selected = selected[selected["data_source"].isin(list(sources))]
    records: list[Mapping[str, Any]] = []
    for index, row in enumerate(selected.itertuples(index=False)):
        records.append(
            {
                "data_source": row.data_source,
                "prompt": render_prompt(template, row.question),
                "ability": "multi_answer_search",
                "reward_model": {"style": "rule", "ground_truth": ground_truth_lists(row.ground_truth)},
                "extra_info": {"index": index, "id": row.id, "split": split, "question": row.question},
                "agent_name": agent_name,
            }
        )
    return pd.DataFrame.from_records(
        records, columns=["data_source", "prompt", "ability", "reward_model", "extra_info", "agent_name"]
    )


def samples_from_verl(frame: pd.DataFrame, limit: int | None = None, seed: int = 0) -> list[SampleRecord]:
    """Training questions (:func:`~spader_pipeline.data.schema.sample_record`) from the VERL parquet
    (``extra_info.question``, ``reward_model.ground_truth``); an optional seeded subset of ``limit``."""
    rows: list[SampleRecord] = []
    for row in frame.to_dict(orient="records"):
        extra, reward = row.get("extra_info") or {}, row.get("reward_model") or {}
        rows.append(sample_record({"id": extra.get("id", len(rows)), "question": extra["question"],
                                   "ground_truth": reward.get("ground_truth", []), "data_source": row.get("data_source")}))
    if limit and len(rows) > limit:
        keep = np.random.default_rng(seed).choice(len(rows), size=int(limit), replace=False)
        rows = [rows[int(i)] for i in sorted(keep)]
    return rows
