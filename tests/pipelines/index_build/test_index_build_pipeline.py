"""The index_build pipeline on the fixture corpus: a real Kedro run with SequentialRunner, and the
configuration files it ships with."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml
from kedro.io import DataCatalog, MemoryDataset
from kedro.runner import SequentialRunner
from kedro_datasets.json import JSONDataset

from spader_pipeline.pipelines.index_build import create_pipeline
from spader_pipeline.retrieval.index import load_retriever

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "retrieval" / "fixtures" / "corpus.jsonl"


def _params(out_dir: Path) -> dict:
    params = yaml.safe_load((ROOT / "conf/base/parameters_index_build.yml").read_text())["index_build"]
    params.update(out_dir=str(out_dir), show_progress=False)
    params["probe"]["num_queries"] = 20
    return params


def test_pipeline_builds_manifest_and_metrics(tmp_path):
    corpus = pd.read_json(FIXTURE, lines=True, dtype={"id": str})  # what the catalog's `corpus` loads
    catalog = DataCatalog({
        "corpus": MemoryDataset(corpus),
        "params:index_build": MemoryDataset(_params(tmp_path / "models")),
        "index_manifest": JSONDataset(filepath=str(tmp_path / "index_manifest.json")),
        "index_build_metrics": JSONDataset(filepath=str(tmp_path / "index_build_metrics.json")),
    })
    SequentialRunner().run(create_pipeline(), catalog)
    manifest = catalog.load("index_manifest")
    metrics = catalog.load("index_build_metrics")
    assert manifest["method"] == "bm25" and manifest["corpus"]["num_passages"] == len(corpus)
    assert Path(manifest["index_dir"]) == tmp_path / "models" / "bm25"
    assert metrics["num_passages"] == len(corpus) and metrics["index_mb"] > 0
    assert metrics["probe_title_recall_at_k"] >= 0.9
    assert all(isinstance(v, float) for v in metrics.values())
    assert load_retriever(manifest["index_dir"]).search(["Accra"], 1)[0].documents[0].title == "Ghana"


def test_catalog_entries_are_versioned_json():
    catalog = yaml.safe_load((ROOT / "conf/base/catalog_index_build.yml").read_text())
    for name in ("index_manifest", "index_build_metrics"):
        assert catalog[name]["type"] == "json.JSONDataset" and catalog[name]["versioned"] is True
    assert create_pipeline().inputs() == {"corpus", "params:index_build"}
