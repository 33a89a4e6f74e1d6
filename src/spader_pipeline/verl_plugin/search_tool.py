"""The project's search tool for stock VERL (``verl.tools.base_tool.BaseTool``).

Declared in ``conf/base/verl/tool_config/search_tool.yaml`` (``rollout.multi_turn.tool_config_path``).
``execute`` calls the retrieval service through :class:`spader_pipeline.retrieval.RetrievalClient`
and renders the observation with :func:`spader_pipeline.agent.rollout.observe_search` — the very
function the project's rollout uses, so the text a policy reads is identical in VERL training, in
the native trainer and in evaluation (the SPADER reference code showed training and evaluation
differently formatted observations; docs/agent.md). Failures never raise: the model gets an
error observation and the metrics dict carries the error.

Config keys (all optional except the URL): ``retrieval_service_url``, ``topk`` (5), ``max_chars``
(10000, the server's dynamic top-k budget), ``max_observation_chars`` (11000), ``max_queries_per_call``
(16), ``max_document_chars`` (none: whole passages; each passage cut to its title and evidence line,
as the native trainer's ``rollout.max_document_chars``), ``timeout`` (30 s), ``max_retries`` (3),
``backoff`` (0.5 s).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from spader_pipeline.agent.protocol import normalize_string_list
from spader_pipeline.agent.search_step import observe_search
from spader_pipeline.agent.types import RolloutConfig
from spader_pipeline.retrieval import RetrievalClient

logger = logging.getLogger(__name__)

#: Used when the YAML declares no schema. The text protocol never shows it to the model; it only
#: matters to VERL's prompt-length filter and to the hermes/JSON tool-call formats.
DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search a Wikipedia index; returns the top passages for every query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {"type": "array", "items": {"type": "string"}, "description": "search queries"}
            },
            "required": ["query_list"],
        },
    },
}


class SearchTool(BaseTool):
    """``search(query_list)`` over the project's retrieval service (see the module docstring)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(DEFAULT_SCHEMA)
        super().__init__(config, schema)
        if not config.get("retrieval_service_url"):
            raise ValueError("SearchTool needs config.retrieval_service_url (e.g. http://127.0.0.1:8000)")
        self.url = str(config["retrieval_service_url"])
        self.rollout_config = RolloutConfig(
            topk=int(config.get("topk", 5)),
            max_chars=config.get("max_chars", 10000),
            max_observation_chars=config.get("max_observation_chars", 11000),
            max_queries_per_call=int(config.get("max_queries_per_call", 16)),
            max_document_chars=int(config["max_document_chars"]) if config.get("max_document_chars") else None,
        )
        self.client_options = {
            "timeout": float(config.get("timeout", 30.0)),
            "max_retries": int(config.get("max_retries", 3)),
            "backoff": float(config.get("backoff", 0.5)),
        }
        self._clients: dict[int, RetrievalClient] = {}

    def client(self) -> RetrievalClient:
        """The retrieval client of the running event loop (httpx clients are bound to one loop)."""
        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            self._clients[key] = RetrievalClient(self.url, **self.client_options)
        return self._clients[key]

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        queries = (
            normalize_string_list(parameters.get("query_list") if isinstance(parameters, dict) else None)
            or ()
        )
        outcome = await observe_search(self.client(), queries, self.rollout_config)
        metrics: dict[str, Any] = {"num_queries": len(outcome.queries), "doc_ids": outcome.doc_ids}
        if outcome.error:
            metrics["error"] = outcome.error
        return ToolResponse(text=outcome.text), 0.0, metrics
