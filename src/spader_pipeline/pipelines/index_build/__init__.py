"""index_build: corpus → retrieval index folder + versioned manifest + build metrics."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
