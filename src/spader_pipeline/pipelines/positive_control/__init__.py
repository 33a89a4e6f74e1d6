"""``make positive-control`` (``kedro run --env positive_control --pipeline positive_control``): GRPO
and SPADER, 2 seeds each, fit a few training questions from the shared warm start (docs/results.md)."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
