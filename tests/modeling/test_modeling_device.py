"""The one device rule of in-process models."""

from __future__ import annotations

import torch

from spader_pipeline.modeling.device import resolve_device


def test_auto_is_cuda_when_available_and_an_explicit_device_is_kept():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == resolve_device(None) == resolve_device() == expected
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
