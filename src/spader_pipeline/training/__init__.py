"""``training`` typed once (:mod:`.settings`) and the table of backends that train (:mod:`.registry`,
filled by :mod:`.backends`).

The Kedro training nodes type the ``training`` parameters, with a method's block, as
:class:`~.settings.TrainingSettings` before any child process starts, then hand the settings to the
backend the table names; the portable run builds its trainer's configuration from the same settings.
The backends register as the package is imported, before any settings are typed.
"""

from spader_pipeline.training import backends as _backends  # noqa: F401  (registers native and verl)
from spader_pipeline.training.registry import get_backend
from spader_pipeline.training.settings import TrainingSettings

__all__ = ["TrainingSettings", "get_backend"]
