"""RolloutConfig.max_document_chars: short passages in observations, and rewards see only what was shown."""

from __future__ import annotations

import asyncio

from spader_pipeline.agent.search_step import observe_search
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.retrieval.schemas import SearchResponse

LONG = "Country in West Africa. Ghana is a country with a long coast, many rivers and a capital city called Accra."


class _Search:
    async def search(self, queries, topk=5, max_chars=None):
        return SearchResponse.model_validate(
            {"results": [{"query": q, "documents": [{"id": "1", "title": "Ghana", "contents": LONG},
                                                    {"id": "2", "title": "Togo", "contents": "Short one."}]}
                         for q in queries]})


def test_passages_are_cut_at_a_word_boundary_and_the_records_match_the_observation():
    outcome = asyncio.run(observe_search(_Search(), ["ghana"], RolloutConfig(max_document_chars=40)))
    assert "Doc 1 (Title: Ghana) Country in West Africa. Ghana is a …" in outcome.text
    assert "Doc 2 (Title: Togo) Short one." in outcome.text and "Accra" not in outcome.text
    assert outcome.retrieved_texts == ["Ghana\nCountry in West Africa. Ghana is a …", "Togo\nShort one."]
    assert outcome.doc_ids == [["1", "2"]] and outcome.titles == [["Ghana", "Togo"]]
    full = asyncio.run(observe_search(_Search(), ["ghana"], RolloutConfig()))
    assert "Accra" in full.text
