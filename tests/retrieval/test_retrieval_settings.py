"""One retrieval-settings type for the warm start, RL rollouts and evaluation."""

from __future__ import annotations

import pytest

from spader_pipeline.retrieval.settings import RetrievalSettings, retrieval_settings, service_url


def test_unknown_keys_and_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"unknown evaluate.retrieval settings \['retrieval_url'\]"):
        retrieval_settings({"retrieval_url": "http://x"}, where="evaluate.retrieval")
    with pytest.raises(ValueError, match="mode"):
        RetrievalSettings(mode="remote")
    assert retrieval_settings({"mode": "local"}, where="search").mode == "local"
    with pytest.raises(ValueError, match="advertised_host"):
        RetrievalSettings(bind_host="0.0.0.0")
    assert RetrievalSettings(bind_host="::", advertised_host="fd00::4").advertised_url(80) == "http://[fd00::4]:80"


def test_service_url_prefers_the_configured_url_and_refuses_local_mode(tmp_path):
    with service_url(RetrievalSettings(url="http://10.0.0.2:8000"), tmp_path) as url:
        assert url == "http://10.0.0.2:8000"
    with pytest.raises(ValueError, match="HTTP"), service_url(RetrievalSettings(mode="local"), tmp_path):
        pass


def test_service_url_starts_a_service_on_the_index(bm25_index):
    """Bound to every interface, reached at the advertised address (as VERL's workers on other nodes do)."""
    import httpx

    with service_url(RetrievalSettings(bind_host="0.0.0.0", advertised_host="127.0.0.1"), bm25_index) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


def test_service_url_checks_the_url_before_anything_starts(tmp_path):
    seen = []

    def refuse(url):
        seen.append(url)
        raise ValueError("unusable")

    with pytest.raises(ValueError, match="unusable"), service_url(RetrievalSettings(), tmp_path / "no-index", check=refuse):
        pass
    assert seen and seen[0].startswith("http://127.0.0.1:")  # refused before a service on the missing index


def test_search_backend_is_the_index_in_process_or_a_client_on_the_service(bm25_index):
    import asyncio

    from spader_pipeline.retrieval import RetrievalClient
    from spader_pipeline.retrieval.service import LocalSearch
    from spader_pipeline.retrieval.settings import search_backend

    with search_backend({"mode": "local"}, bm25_index, where="search") as local:
        assert isinstance(local, LocalSearch)
        in_process = asyncio.run(local.search(["capital"], topk=2))
    with search_backend(None, bm25_index, where="search") as client:  # default: service
        assert isinstance(client, RetrievalClient)
        assert asyncio.run(client.search(["capital"], topk=2)) == in_process
    with pytest.raises(ValueError, match=r"unknown training.search settings \['host'\]"), \
            search_backend({"host": "x"}, bm25_index, where="training.search"):
        pass
