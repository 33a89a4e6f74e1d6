"""``data_prep``: corpus and QA data for the embedded default and the configured benchmarks."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
