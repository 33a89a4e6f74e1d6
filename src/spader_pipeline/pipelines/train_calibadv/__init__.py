"""``train_calibadv``: the modular RL pipeline (:func:`spader_pipeline.pipelines.training.method_pipeline`)
under the namespace ``train_calibadv``; its method settings are ``train_calibadv.method`` in
conf/base/parameters_training.yml."""

from .pipeline import create_pipeline

__all__ = ["create_pipeline"]
