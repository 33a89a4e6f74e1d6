"""Which torch device a model runs on: one rule for every stage that loads a model in process
(the native trainer's ``device`` setting, an evaluation model's ``device`` option)."""

from __future__ import annotations

__all__ = ["resolve_device"]


def resolve_device(setting: str | None = "auto") -> str:
    """``setting`` as given (``cpu``, ``cuda``, ``cuda:1``); ``"auto"`` or unset: CUDA when
    available, else the CPU."""
    if setting in (None, "", "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(setting)
