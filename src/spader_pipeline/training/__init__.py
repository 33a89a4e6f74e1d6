"""``training`` typed once (:mod:`.settings`) and the table of backends that train (:mod:`.backends`).

The Kedro training nodes type the ``training`` parameters, with a method's block, as
:class:`~.settings.TrainingSettings` before any child process starts, then hand the settings to the
backend the table names; the portable run builds its trainer's configuration from the same settings.
"""

from spader_pipeline.training.settings import TrainingSettings

__all__ = ["TrainingSettings"]
