"""Native single-process RL trainer (CPU or one GPU): config, batch layout, checkpoints, loop."""

from spader_pipeline.native.config import NativeTrainerConfig
from spader_pipeline.native.trainer import TrainResult, train_native

__all__ = ["NativeTrainerConfig", "TrainResult", "train_native"]
