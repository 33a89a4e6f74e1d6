"""Kedro project settings. See https://docs.kedro.org/en/stable/kedro_project_setup/settings.html"""

from kedro.config import OmegaConfigLoader

from spader_pipeline.hooks import (
    CompareCellsHooks,
    DataRootLockHooks,
    ForkServerHooks,
    MlflowTrackingHooks,
    TrainingSettingsHooks,
)

HOOKS = (MlflowTrackingHooks(), DataRootLockHooks(), CompareCellsHooks(), TrainingSettingsHooks(), ForkServerHooks())

CONFIG_LOADER_CLASS = OmegaConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    "config_patterns": {
        "mlflow": ["mlflow*", "mlflow*/**"],
    },
    # Environments (conf/test, conf/local) override single keys instead of whole top-level blocks.
    "merge_strategy": {"parameters": "soft", "mlflow": "soft"},
}
