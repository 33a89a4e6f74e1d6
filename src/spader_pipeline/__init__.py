"""spader-pipeline: RL training and evaluation of multi-answer search agents (SPADER, GRPO, CalibAdv, TSPO)."""

__version__ = "0.1.0"
