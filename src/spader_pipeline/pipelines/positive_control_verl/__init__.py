"""``make positive-control-verl`` (``python -m spader_pipeline.grid --env positive_control --pipeline
positive_control_verl``): the positive control's cells trained through verl's real loop too, beside
the native cells, on the same data root, fitted questions and target, in one report (docs/results.md)."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
