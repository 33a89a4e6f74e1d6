"""``report``: GRPO-vs-SPADER comparison (training curves, final held-out metrics) in 08_reporting and MLflow."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
