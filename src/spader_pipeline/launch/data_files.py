"""The files a verl launch reads: the training and validation parquet, and the search tool's config
pointing at the run's retrieval service."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from spader_pipeline.launch.settings import VerlSettings
from spader_pipeline.retrieval.settings import RetrievalSettings

if TYPE_CHECKING:
    import pandas as pd

#: the parquet files of a launch (``training.verl`` settings and ``build_overrides`` keys)
DATA_KEYS = ("train_files", "val_files")


def data_files(
    verl: VerlSettings, run_dir: str | Path, train: pd.DataFrame | None = None, validation: pd.DataFrame | None = None
) -> dict[str, str]:
    """The parquet files verl reads, as ``{"train_files", "val_files"}``.

    A configured ``training.verl.train_files``/``val_files`` must exist; otherwise the node's dataset
    (``verl_train``/``verl_validation``, from the catalog, so wherever ``data_root`` puts it) is
    written to ``<run_dir>/data/<split>.parquet``, which every node of the cluster reads like the
    checkpoints. Neither: an error naming the setting.
    """
    out: dict[str, str] = {}
    for key, frame, split in (("train_files", train, "train"), ("val_files", validation, "validation")):
        configured = getattr(verl, key)
        if configured:
            path = Path(configured)
            if not path.is_file():
                raise FileNotFoundError(f"training.verl.{key}={configured} does not exist (null: the catalog's "
                                        f"verl_{split} dataset, written by data_prep)")
        elif frame is not None:
            path = Path(run_dir) / "data" / f"{split}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_parquet(path, index=False)
        else:
            raise ValueError(f"training.verl.{key} is null and no verl_{split} dataset was given to the launch")
        out[key] = str(path.resolve())
    return out


def write_tool_config(template: str | Path, url: str, out: str | Path, settings: RetrievalSettings | None = None,
                      tool: Mapping[str, Any] | None = None) -> Path:
    """Copy the search-tool config with ``retrieval_service_url`` set to ``url``, given ``settings`` its
    client ``timeout`` and ``max_retries`` set from them, and ``tool`` (``training.verl.search_tool``:
    ``topk``, ``max_observation_chars``, ``max_document_chars``, ...) over the template's values."""
    config = yaml.safe_load(Path(template).read_text())
    client = {} if settings is None else {"timeout": settings.timeout, "max_retries": settings.max_retries}
    for entry in config.get("tools", []):
        entry.setdefault("config", {}).update(**dict(tool or {}), retrieval_service_url=url, **client)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out
