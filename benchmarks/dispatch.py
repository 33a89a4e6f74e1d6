"""What a way costs the host beside its time: the ATen operations it dispatches (on a GPU each is a kernel
launch or the host's time before one) and those that make the host wait for the device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "slice", "unsqueeze", "squeeze", "expand", "detach",
                   "select", "alias", "permute", "as_strided", "_reshape_alias", "lift_fresh"})
WAITS = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero"})  # the host reads a device value


class DispatchCount(TorchDispatchMode):
    """Operations dispatched (views left out), and those that make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = 0
        self.waits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.operations += 1
        if name in WAITS and any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
            self.waits += 1
        return func(*args, **(kwargs or {}))
