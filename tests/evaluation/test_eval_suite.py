"""Which models an evaluation runs (catalog manifests + configuration, strictly) and the suite loop
with its resources: a real retrieval service on 127.0.0.1, the scripted policy, resume by key."""

from __future__ import annotations

import json
import logging
import re

import pytest

from spader_pipeline.evaluation.config import EvaluationConfig
from spader_pipeline.evaluation.models import ModelSpec, ModelUnavailableError
from spader_pipeline.evaluation.suite import _expected_cost, evaluate_models, select_models

TRAINED = {"kind": "hf", "batch_size": 4, "sampling": {"max_new_tokens": 8}}


def _checkpoint(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_config_is_strict_and_typed():
    config = EvaluationConfig.from_mapping({"datasets": ["a"], "long_tail": {"edges": [1, 3]}, "runner": {"resume": False}})
    assert config.datasets == ("a",) and config.long_tail.edges == (1, 3) and config.runner.resume is False
    with pytest.raises(ValueError, match=r"unknown evaluate.runner settings \['resum'\]"):
        EvaluationConfig.from_mapping({"runner": {"resum": False}})
    with pytest.raises(ValueError, match="unknown evaluate settings"):
        EvaluationConfig.from_mapping({"modles": []})
    with pytest.raises(ValueError, match="come from the catalog"):
        EvaluationConfig.from_mapping({"trained_models": {"path": "data/06_models/train_grpo/final"}})


def test_catalog_overrides_merge_over_trained_models_per_model():
    config = EvaluationConfig.from_mapping({
        "trained_models": {"kind": "hf", "batch_size": 4, "sampling": {"temperature": 0.0, "max_new_tokens": 96},
                           "rollout": {"max_turns": 6, "topk": 3}},
        "catalog_overrides": {"base": {"sampling": {"max_new_tokens": 48}, "rollout": {"max_turns": 2}}},
    })
    assert config.catalog_settings("base") == {"kind": "hf", "batch_size": 4,
                                               "sampling": {"temperature": 0.0, "max_new_tokens": 48},
                                               "rollout": {"max_turns": 2, "topk": 3}}
    assert config.catalog_settings("warm_start") == config.trained_models
    with pytest.raises(ValueError, match="come from the catalog"):
        EvaluationConfig.from_mapping({"catalog_overrides": {"base": {"path": "elsewhere"}}})


def test_trained_models_come_from_their_manifests_with_the_training_link(tmp_path):
    """The merged VERL folder is wherever the manifest says (not under train_<m>/final)."""
    merged = _checkpoint(tmp_path / "06_models/merged/train_spader")
    manifest = {"path": str(merged), "method": "spader", "backend": "verl", "mlflow_run_id": "abc"}
    spec = ModelSpec.from_manifest("spader", manifest, TRAINED, source="spader_model_manifest",
                                   training_link={"method": "spader", "training_run_id": "abc"})
    assert (spec.kind, spec.path, spec.batch_size) == ("hf", str(merged), 4)
    assert spec.training_link == {"method": "spader", "training_run_id": "abc"}
    config = EvaluationConfig.from_mapping({"models": [{"name": "scripted", "kind": "scripted"}]})
    assert [m.name for m in select_models(config, [spec])] == ["spader", "scripted"]
    unmerged = {"path": None, "method": "grpo", "backend": "verl", "actor_dir": "/x"}
    with pytest.raises(ModelUnavailableError, match="merge pipeline"):
        ModelSpec.from_manifest("grpo", unmerged, TRAINED, source="grpo_model_manifest")


def test_a_configured_model_that_is_missing_is_an_error_not_a_skip(tmp_path, caplog):
    gone = {"path": str(tmp_path / "deleted_checkpoint")}
    spec = ModelSpec.from_manifest("grpo", gone, TRAINED, source="grpo_model_manifest")
    with pytest.raises(ModelUnavailableError, match="grpo .*grpo_model_manifest.* no Hugging Face checkpoint"):
        select_models(EvaluationConfig(), [spec])
    endpoint = {"name": "qwen3-8b-spader", "kind": "openai", "base_url": None, "model": "m"}
    with pytest.raises(ModelUnavailableError, match="qwen3-8b-spader .*base_url"):
        select_models(EvaluationConfig.from_mapping({"models": [endpoint]}))
    with caplog.at_level(logging.INFO):
        assert select_models(EvaluationConfig.from_mapping({"models": [{**endpoint, "enabled": False}]})) == []
    assert "qwen3-8b-spader is disabled" in caplog.text
    twice = {"models": [{"name": "grpo", "kind": "scripted"}]}
    with pytest.raises(ValueError, match="unique"):
        select_models(EvaluationConfig.from_mapping(twice), [ModelSpec.from_manifest("grpo", {"path": str(_checkpoint(tmp_path / "g"))}, TRAINED, source="x")])


def test_suite_runs_every_model_on_every_dataset_against_a_real_service_and_resumes(tmp_path, caplog):
    from spader_pipeline.retrieval.index import build_index_from_file

    corpus = tmp_path / "corpus.jsonl"
    docs = [("Ghana", "Country in West Africa."), ("Togo", "Country in West Africa."), ("Hamlet", "Play by William Shakespeare.")]
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "contents": c}) + "\n" for i, (t, c) in enumerate(docs)))
    index_dir = tmp_path / "index"
    build_index_from_file(corpus, index_dir, "bm25", show_progress=False)
    datasets = {
        "west": [{"id": "q1", "question": "Which countries are in West Africa?", "ground_truth": [["Ghana"], ["Togo"]]}],
        "plays": [{"id": "q2", "question": "Which plays were written by William Shakespeare?", "ground_truth": [["Hamlet"]]}],
    }
    config = EvaluationConfig.from_mapping({
        "models": [{"name": "scripted", "kind": "scripted"}, {"name": "lazy", "kind": "scripted", "follow_up": False}],
        "runner": {"work_dir": str(tmp_path / "work"), "progress": False},
    })
    prompt = {"template": "t", "templates": {"t": "Question: {question}"}}
    seen = []
    results = evaluate_models(config, select_models(config), datasets, {}, index_manifest={"index_dir": str(index_dir)},
                              prompt=prompt, on_result=lambda r: seen.append((r.model.name, r.dataset)))
    assert seen == [("scripted", "west"), ("scripted", "plays"), ("lazy", "west"), ("lazy", "plays")]
    assert [r.metrics["recall"] for r in results[:2]] == [1.0, 1.0] and all(r.num_failed == 0 for r in results)
    assert len(list((tmp_path / "work").iterdir())) == 4
    with caplog.at_level(logging.INFO):
        again = evaluate_models(config, select_models(config), datasets, {}, index_manifest={"index_dir": str(index_dir)},
                                prompt=prompt)
    assert caplog.text.count("resuming, 1 of 1 samples already done") == 4
    assert [r.records for r in again] == [r.records for r in results]


def test_an_override_for_a_model_the_catalog_does_not_have_is_an_error(tmp_path):
    from spader_pipeline.pipelines.evaluate.nodes import run_evaluations

    params = {"trained_models": TRAINED, "catalog_overrides": {"bsae": {"rollout": {"max_turns": 2}}}}
    with pytest.raises(ValueError, match=r"catalog_overrides names \['bsae'\], not models of the catalog"):
        run_evaluations({}, {}, {}, params, {}, base={"path": str(_checkpoint(tmp_path / "base"))})


@pytest.mark.parametrize(("setting", "forced", "expected"),
                         [("auto", "on", True), ("auto", "off", False), (True, "off", True), (False, "on", False)])
def test_a_checkpoint_decodes_in_the_precision_its_bf16_option_resolves_to(tmp_path, monkeypatch, setting, forced,
                                                                           expected):
    """``bf16: auto`` follows the machine as validation does (forced here through SPADER_BF16, as
    ``pytest --bf16`` forces it); ``true``/``false`` are taken as given."""
    from spader_pipeline.evaluation.models import open_generator
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model

    texts = [f"Ghana {i} is a country in West Africa." for i in range(20)]
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=128)
    model_dir = build_base_model(texts, tmp_path / "tiny", spec=spec, vocab_size=300, min_frequency=1)
    monkeypatch.setenv("SPADER_BF16", forced)
    model = ModelSpec.from_mapping({"name": "tiny", "kind": "hf", "path": str(model_dir), "bf16": setting,
                                    "device": "cpu"})
    with open_generator(model) as generator:
        assert generator.bf16 is expected


@pytest.mark.heavy
def test_checkpoints_evaluated_side_by_side_give_the_records_of_one_after_another(tmp_path, caplog):
    """``runner.workers: 2``: two child processes at a time, the costliest models started first (the
    order of their start logs is the forkserver's), each with one of the two torch threads; the
    results are those of ``workers: 1``, in the models' order. With ``shards: 2`` each checkpoint is
    two children, one per half of the questions, and its records and metrics are those of one child
    (fp32: a batch's composition does not change the tokens)."""
    import torch

    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
    from spader_pipeline.retrieval.index import build_index_from_file

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "title": t, "contents": "Country in West Africa."}) + "\n"
                              for i, t in enumerate(["Ghana", "Togo", "Benin"])))
    build_index_from_file(corpus, tmp_path / "index", "bm25", show_progress=False)
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=512)
    model_dir = build_base_model([f"Ghana {i} is a country in West Africa." for i in range(20)], tmp_path / "tiny",
                                 spec=spec, vocab_size=300, min_frequency=1)
    hf = {"kind": "hf", "path": str(model_dir), "batch_size": 4, "bf16": False,
          "sampling": {"temperature": 0.0, "max_new_tokens": 6}}
    models = [{"name": "short", **hf, "rollout": {"max_turns": 1}}, {"name": "long_a", **hf, "rollout": {"max_turns": 3}},
              {"name": "scripted", "kind": "scripted"}, {"name": "long_b", **hf, "rollout": {"max_turns": 2}}]
    datasets = {"west": [{"id": f"q{i}", "question": f"Which countries are in West Africa {i}?",
                          "ground_truth": [["Ghana"], ["Togo"]]} for i in range(3)]}
    prompt = {"template": "t", "templates": {"t": "Question: {question}"}}

    def evaluate(workers: int, shards: int = 1) -> tuple[list, list[str]]:
        config = EvaluationConfig.from_mapping({"models": models, "runner": {
            "work_dir": str(tmp_path / f"work{workers}_{shards}"), "progress": False, "workers": workers,
            "shards": shards}})
        seen: list[str] = []
        results = evaluate_models(config, select_models(config), datasets, {}, prompt=prompt,
                                  index_manifest={"index_dir": str(tmp_path / "index")},
                                  on_result=lambda r: seen.append(r.model.name))
        return results, seen

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone, _ = evaluate(1)
        with caplog.at_level(logging.INFO, logger="spader_pipeline.child_process"):
            caplog.clear()
            side_by_side, seen = evaluate(2)
            started = re.findall(r"(evaluate_\w+): running in child process", caplog.text)
            caplog.clear()
            in_parts, seen_in_parts = evaluate(2, shards=2)
            started_in_parts = re.findall(r"(evaluate_\w+): running in child process", caplog.text)
    finally:
        torch.set_num_threads(threads)
    def records(results):  # as JSON: a NaN metric (no answer) equals itself
        return [(r.model.name, json.dumps(r.records, sort_keys=True), json.dumps(r.metrics)) for r in results]

    assert records(side_by_side) == records(alone)
    assert [r.model.name for r in side_by_side] == ["short", "long_a", "scripted", "long_b"]
    assert sorted(seen) == ["long_a", "long_b", "scripted", "short"]
    assert len(started) == 3
    # in parts: the same records and metrics, each model handed over once, when its last part ends
    assert records(in_parts) == records(alone)
    assert sorted(seen_in_parts) == sorted(seen)
    assert sorted(started_in_parts) == sorted(f"evaluate_{m}_part{k}of2" for m in ("short", "long_a", "long_b")
                                              for k in (1, 2))
    # each part resumes from its own work file: questions 0 (first part) and 1-2 (second)
    work = sorted((tmp_path / "work2_2").glob("long_a__west__*.jsonl"))
    assert sorted(len(f.read_text().splitlines()) for f in work) == [1, 2]
    checkpoints = [m for m in select_models(EvaluationConfig.from_mapping({"models": models})) if m.kind == "hf"]
    assert [m.name for m in sorted(checkpoints, key=_expected_cost, reverse=True)] == ["long_a", "long_b", "short"]
