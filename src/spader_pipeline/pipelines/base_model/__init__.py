"""``base_model`` pipeline: validate a configured HF model or build the tiny embedded Qwen3."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
