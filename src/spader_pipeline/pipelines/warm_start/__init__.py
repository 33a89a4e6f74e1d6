"""``warm_start``: SFT of the base model on demonstrations (part of ``training``)."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
