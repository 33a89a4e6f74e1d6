"""``train_tspo``: the modular RL pipeline (:func:`spader_pipeline.pipelines.training.method_pipeline`)
under the namespace ``train_tspo``; its method settings are ``train_tspo.method`` in
conf/base/parameters_training.yml."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
