"""``training`` pipeline: warm start, then GRPO and SPADER (the default run's RL stage).

The per-method pipelines ``train_grpo``, ``train_spader``, ``train_calibadv`` and ``train_tspo``
are the same modular pipeline (:func:`method_pipeline`) under different Kedro namespaces.
"""

from .pipeline import create_pipeline, method_pipeline, warm_start_pipeline

__all__ = ["create_pipeline", "method_pipeline", "warm_start_pipeline"]
