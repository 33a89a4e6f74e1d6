"""``merge``: VERL FSDP checkpoints of each trained method → HF model directories."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
