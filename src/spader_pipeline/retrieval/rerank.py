"""Optional cross-encoder reranking of the first-stage candidates (Nogueira & Cho, 2019).

Configured by a local model folder (GPU default: bge-reranker-v2-m3; CalibAdv used
ms-marco-MiniLM-L12-v2). With no folder configured there is no reranker and requests that ask
for one are served from the first stage alone (the response is unchanged otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class RerankParams:
    model_path: str | None = None  #: local cross-encoder folder; null disables reranking
    batch_size: int = 16
    max_length: int = 512
    device: str = "cpu"
    enabled_by_default: bool = True  #: rerank when a request sends use_reranker: null

    @classmethod
    def from_dict(cls, values: dict | None) -> RerankParams:
        return cls(**dict(values or {}))


class CrossEncoderReranker:
    """Scores ``(query, passage)`` pairs; the score is the model's raw logit (higher = better)."""

    def __init__(self, params: RerankParams) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import CrossEncoder

        if not params.model_path or not Path(params.model_path).exists():
            raise FileNotFoundError(f"reranker folder {params.model_path!r} does not exist")
        self.params = params
        self.model = CrossEncoder(params.model_path, device=params.device, max_length=params.max_length,
                                  local_files_only=True)

    def scores(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """``[len(passages)]`` float32 relevance logits."""
        if not passages:
            return np.empty(0, np.float32)
        import torch

        pairs = [(query, p) for p in passages]
        out = self.model.predict(pairs, batch_size=self.params.batch_size, show_progress_bar=False,
                                 activation_fn=torch.nn.Identity(), convert_to_numpy=True)
        return np.asarray(out, dtype=np.float32).reshape(-1)
