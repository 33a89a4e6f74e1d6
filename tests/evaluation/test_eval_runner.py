"""The evaluation runner: every sample gets a record, failures are retried then counted, resume skips."""

from __future__ import annotations

import asyncio
import json

import pytest

from spader_pipeline.agent.scripted import ScriptedPolicy
from spader_pipeline.agent.types import GeneratedTurn, RolloutConfig
from spader_pipeline.evaluation.models import ModelSpec
from spader_pipeline.evaluation.runner import evaluate_dataset, fingerprint, read_work_file
from spader_pipeline.retrieval.service import LocalSearch

CORPUS = [
    {"id": "0", "title": "Ghana", "contents": "Country in West Africa. Accra is the capital."},
    {"id": "1", "title": "Togo", "contents": "Country in West Africa. Lome is the capital."},
    {"id": "2", "title": "Kenya", "contents": "Country in East Africa. Nairobi is the capital."},
    {"id": "3", "title": "Hamlet", "contents": "Play by William Shakespeare. A Danish prince."},
]
SAMPLES = [
    {
        "id": "a",
        "question": "Which countries are in West Africa?",
        "ground_truth": [["Ghana"], ["Togo"]],
        "data_source": "toy",
    },
    {
        "id": "b",
        "question": "Which plays were written by William Shakespeare?",
        "ground_truth": [["Hamlet"]],
        "data_source": "toy",
    },
    {
        "id": "c",
        "question": "Which countries are in East Africa?",
        "ground_truth": [["Kenya"]],
        "data_source": "toy",
    },
]


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    from spader_pipeline.retrieval import build_index, load_retriever
    from spader_pipeline.retrieval.corpus import iter_records

    out = tmp_path_factory.mktemp("runner-index") / "bm25"
    build_index(iter_records(CORPUS), out, "bm25")
    return LocalSearch(load_retriever(out))


class Flaky(ScriptedPolicy):
    """The scripted policy, except that sample ``fail_id`` errors ``failures`` times."""

    def __init__(self, fail_id: str, failures: int):
        super().__init__()
        self.fail_id, self.left = fail_id, failures
        self.calls: dict[str, int] = {}

    async def generate(self, states):
        out = []
        for s in states:
            sid = s.sample["id"]
            self.calls[sid] = self.calls.get(sid, 0) + 1
            if sid == self.fail_id and self.left > 0:
                self.left -= 1
                out.append(GeneratedTurn(text="", error="server hiccup"))
            else:
                out.append(GeneratedTurn(text=self.turn(s)))
        return out


def _run(search, generator, **kwargs):
    return asyncio.run(
        evaluate_dataset(
            SAMPLES, generator, search, RolloutConfig(topk=3), "Q: {question}", progress=False, **kwargs
        )
    )


def test_transient_failures_are_retried(search):
    records = _run(search, Flaky("b", failures=2), max_attempts=3, concurrency=2)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert all(r["status"] == "ok" for r in records)
    assert records[0]["predicted"] == ["Ghana", "Togo"] and records[0]["f1"] == 1.0
    assert records[1]["history"][0]["content"].startswith("Q: Which plays")
    # per-step metadata: the gold entities each step's retrieved documents contain
    assert set(records[0]["steps"][0]["entities_found"]) == {"Ghana", "Togo"}
    assert records[0]["steps"][-1]["entities_found"] == [] and records[0]["steps"][-1]["kind"] == "answer"


def test_persistent_failures_are_counted_not_dropped(search, tmp_path):
    work = tmp_path / "work.jsonl"
    records = _run(search, Flaky("b", failures=99), max_attempts=2, work_file=work, batch_size=2)
    assert [r["status"] for r in records] == ["ok", "failed", "ok"]
    assert records[1]["attempts"] == 2 and "server hiccup" in records[1]["error"]
    assert set(read_work_file(work)) == {"a", "c"}  # failures are not cached: a rerun retries them

    # resume: only the failed sample runs again
    generator = Flaky("none", failures=0)
    again = _run(search, generator, work_file=work)
    assert [r["status"] for r in again] == ["ok", "ok", "ok"]
    assert set(generator.calls) == {"b"}
    assert len(work.read_text().splitlines()) == 3
    # a torn last line (interrupted write) is ignored
    work.write_text(work.read_text() + '{"id": "x", "sta')
    assert set(read_work_file(work)) == {"a", "b", "c"}
    assert {json.loads(line)["id"] for line in work.read_text().splitlines()[:3]} == {"a", "b", "c"}


class FlakySearch:
    """The real in-process searcher, except that its first ``failures`` calls raise."""

    def __init__(self, inner, failures):
        self.inner, self.left = inner, failures

    async def search(self, queries, topk=5, max_chars=None):
        if self.left > 0:
            self.left -= 1
            raise ConnectionError("retrieval service down")
        return await self.inner.search(queries, topk, max_chars)


def test_search_outages_are_failed_attempts_not_scores(search):
    records = _run(FlakySearch(search, failures=1), ScriptedPolicy(), max_attempts=2)
    assert [r["status"] for r in records] == ["ok", "ok", "ok"]  # the affected sample was rerun
    assert records[0]["f1"] == 1.0
    down = _run(FlakySearch(search, failures=10**6), ScriptedPolicy(), max_attempts=2)
    assert {r["status"] for r in down} == {"failed"}
    assert "search failed: ConnectionError" in down[0]["error"]
    lenient = _run(FlakySearch(search, failures=10**6), ScriptedPolicy(), retry_on_search_error=False)
    assert {r["status"] for r in lenient} == {"ok"} and all(r["f1"] == 0.0 for r in lenient)


class UninstalledSearch:
    async def search(self, queries, topk=5, max_chars=None):
        raise ModuleNotFoundError("No module named 'scipy'")


def test_a_search_that_cannot_run_stops_the_evaluation():
    """A missing module fails every attempt alike: the evaluation stops on it, not on a table of failures."""
    with pytest.raises(ModuleNotFoundError, match="scipy"):
        _run(UninstalledSearch(), ScriptedPolicy(), max_attempts=2)


def test_model_specs_and_availability(tmp_path):
    spec = ModelSpec.from_mapping({"name": "s", "kind": "scripted", "follow_up": False})
    assert spec.options == {"follow_up": False} and spec.unavailable_reason() is None
    missing = ModelSpec.from_mapping({"name": "m", "kind": "hf", "path": str(tmp_path / "nope")})
    assert "no Hugging Face checkpoint" in missing.unavailable_reason()
    assert "base_url" in ModelSpec.from_mapping({"name": "o", "kind": "openai"}).unavailable_reason()
    with pytest.raises(ValueError, match="kind must be one of"):
        ModelSpec.from_mapping({"name": "x", "kind": "magic"})
    # an option of another kind, or a typo, is refused (not silently passed on or dropped)
    with pytest.raises(ValueError, match=r"unknown evaluate model 's' \(kind scripted.*\['timeout'\]"):
        ModelSpec.from_mapping({"name": "s", "kind": "scripted", "timeout": 5})
    with pytest.raises(ValueError, match=r"\['batchsize'\]"):
        ModelSpec.from_mapping({"name": "m", "kind": "hf", "path": "p", "batchsize": 4})
    endpoint = ModelSpec.from_mapping({"name": "o", "kind": "openai", "timeout": 5, "concurrency": 2})
    assert (endpoint.options, endpoint.concurrency) == ({"timeout": 5}, 2)
    assert fingerprint({"a": 1}, "t") == fingerprint({"a": 1}, "t") != fingerprint({"a": 2}, "t")


def test_checkpoint_identity_changes_when_weights_are_rewritten(tmp_path):
    """Resume must not reuse a previous checkpoint's results after retraining into the same folder."""
    import os

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"old weights")
    spec = ModelSpec.from_mapping({"name": "spader", "kind": "hf", "path": str(tmp_path)})
    before = spec.checkpoint_identity()
    assert [name for name, _, _ in before] == ["model.safetensors"]
    weights.write_bytes(b"new weights!")
    os.utime(weights, ns=(before[0][2] + 10**9, before[0][2] + 10**9))
    after = spec.checkpoint_identity()
    assert after != before
    assert fingerprint(spec.describe(), before) != fingerprint(spec.describe(), after)
    assert ModelSpec.from_mapping({"name": "s", "kind": "scripted"}).checkpoint_identity() == []
