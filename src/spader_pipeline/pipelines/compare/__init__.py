"""``make compare`` (``kedro run --env compare --pipeline compare``): two methods, several seeds,
one shared warm start, held-out scores with confidence intervals (docs/results.md)."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
