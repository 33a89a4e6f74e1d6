"""evaluate: every configured model × evaluation set → per-sample records, a metrics table,
nested MLflow runs and a comparison plot (docs/metrics.md, docs/agent.md)."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
