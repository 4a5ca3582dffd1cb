"""`HostSyncProbe`: records torch calls that would make the host wait for a CUDA device.

On CPU nothing synchronises, so the probe looks at the calls themselves (a `TorchFunctionMode`): reading a tensor's
value on the host (``item``, ``tolist``, ``bool``/``int``/``float``, ``numpy``), data-dependent output shapes
(``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing) and ``multinomial`` (whose CUDA path checks its
input on the host). The device check (`scripts/gpu_check.py`, section ``sync_debug``) runs the same path under
``torch.cuda.set_sync_debug_mode("error")`` on a real GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
    torch.masked_select, torch.unique, torch.Tensor.unique, torch.multinomial, torch.Tensor.multinomial,
}


class HostSyncProbe(TorchFunctionMode):
    """``with HostSyncProbe() as p: ...`` then ``p.calls``: names of the syncing calls made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SYNCING:
            self.calls.append(getattr(func, "__name__", str(func)))
        elif func is torch.Tensor.__getitem__ and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                self.calls.append("boolean-mask indexing")
        return func(*args, **kwargs)
