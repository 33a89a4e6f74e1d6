"""Corpus streaming, the memory-mapped doc store, the lazy Kedro corpus dataset and the CLI."""

from __future__ import annotations

import pandas as pd
import pytest

from spader_pipeline.retrieval.cli import main
from spader_pipeline.retrieval.corpus import CorpusError, DocStore, DocStoreWriter, iter_corpus
from spader_pipeline.retrieval.datasets import CorpusFile, CorpusFileDataset
from spader_pipeline.retrieval.index import load_retriever, read_manifest


def test_iter_corpus_streams_and_normalises(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"id": "a", "title": "T", "contents": "x"}\n\n'
        '{"id": 7, "contents": "no title"}\n'
        '{"contents": "QAMPARI style", "meta": {"title": "From meta"}}\n',
        encoding="utf-8",
    )
    stream = iter_corpus(path)
    assert not isinstance(stream, list)
    passages = list(stream)
    assert [(p.id, p.title, p.contents) for p in passages] == [
        ("a", "T", "x"), ("7", "", "no title"), ("3", "From meta", "QAMPARI style")]


def test_dataframe_rows_with_missing_titles():
    from spader_pipeline.retrieval.corpus import iter_records

    frame = pd.DataFrame({"id": ["1", "2"], "title": ["A", None], "contents": ["x", "y"]})
    assert [p.title for p in iter_records(frame.to_dict("records"))] == ["A", ""]


def test_bad_lines_raise_with_location_or_are_skipped(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "a", "contents": "ok"}\n{broken\n{"id": "b", "contents": 5}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"c.jsonl:2"):
        list(iter_corpus(path))
    assert [p.id for p in iter_corpus(path, skip_bad=True)] == ["a"]


def test_docstore_round_trip_with_unicode(tmp_path):
    from spader_pipeline.retrieval.corpus import Passage

    writer = DocStoreWriter(tmp_path)
    items = [Passage(str(i), f"Tïtle {i}", "naïve café ☕ " * i) for i in range(50)]
    for p in items:
        writer.add(p)
    writer.close()
    store = DocStore(tmp_path)
    assert len(store) == 50
    assert store.get(49) == {"id": "49", "title": "Tïtle 49", "contents": "naïve café ☕ " * 49}
    with pytest.raises(IndexError):
        store.get(50)
    store.close()


def test_corpus_file_dataset_streams_and_saves(tmp_path):
    dataset = CorpusFileDataset(str(tmp_path / "out" / "corpus.jsonl"))
    dataset.save(pd.DataFrame({"id": ["1", "2"], "title": ["A", "B"], "contents": ["x", "y"]}))
    loaded = dataset.load()
    assert isinstance(loaded, CorpusFile)
    assert [p.title for p in loaded] == ["A", "B"]


def test_cli_build_writes_a_servable_index(tmp_path, corpus_path, capsys):
    out = tmp_path / "idx"
    assert main(["build", "--corpus", str(corpus_path), "--out", str(out), "--method", "bm25",
                 "--set", "bm25.k1=1.2", "--quiet"]) == 0
    assert '"method": "bm25"' in capsys.readouterr().out  # the manifest is printed
    assert read_manifest(out)["parameters"]["k1"] == 1.2
    assert load_retriever(out).search(["Accra"], 1)[0].documents[0].title == "Ghana"


def test_cli_rejects_unknown_method(corpus_path, tmp_path):
    with pytest.raises(SystemExit):
        main(["build", "--corpus", str(corpus_path), "--out", str(tmp_path), "--method", "splade"])


def test_lucene_backend_is_selectable_and_explains_what_it_needs(tmp_path, corpus_path):
    import importlib.util
    import shutil

    from spader_pipeline.retrieval.index import build_index_from_file

    if importlib.util.find_spec("pyserini") is not None and shutil.which("java"):
        pytest.skip("pyserini and Java are installed: the backend would really build")
    with pytest.raises(RuntimeError, match="lucene backend needs"):
        build_index_from_file(corpus_path, tmp_path, "lucene", show_progress=False)
