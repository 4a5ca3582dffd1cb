"""The CPU runner's linear layers through oneDNN instead of torch's default CPU GEMM (MKL).

Why: on the project's AMD EPYC machine, float32 ``F.linear`` with few rows is far from the memory bandwidth it
should reach: SmolLM2's LM head (49,152 x 576) took 12 ms for 1 row and 38 ms for 3 rows (3-9 GB/s of weights),
against 6.6 and 7.4 ms through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the op torch's inductor
compiles CPU linears to); the 30 layers' projections took 1.1-2.1x longer for 1-32 rows (2026-12-03, 2 threads,
`python -m cbnb.bench` measures the end-to-end effect). A decode step is mostly these GEMMs.

How: `route(model)` gives every float32 CPU ``nn.Linear`` of the model its own ``forward`` that takes the oneDNN
op only while `onednn()` is active in the calling thread (the runner's eager forward); anywhere else (the user's
own ``model.generate``, another thread) the module computes ``F.linear`` as before. `unroute(model)` removes it.
The switch is cbnb's CPU fast path: ``CBNB_CPU_KERNELS=0`` turns it off with the decode kernel (the "fast path
off" of the oracle tests); ``CBNB_ONEDNN_LINEAR=0`` turns off this part alone (``python -m cbnb.bench --variants
onednn_linear=off,onednn_linear=on`` compares the two). `available()` is False, once, when this torch has no oneDNN linear or its result
differs from ``F.linear`` beyond float32 rounding; the runner then keeps ``F.linear``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .cpu_kernels import enabled

__all__ = ["available", "wanted", "onednn", "route", "unroute", "runner_linear"]

_local = threading.local()
_checked: bool | None = None
_lock = threading.Lock()
_MARK = "_cbnb_linear"


def _op():
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def wanted() -> bool:
    """The CPU fast path is on and ``CBNB_ONEDNN_LINEAR`` is not 0 (read at every call, like `enabled`)."""
    return enabled() and os.environ.get("CBNB_ONEDNN_LINEAR", "1") not in ("0", "false", "off", "no")


def available() -> bool:
    """Whether torch's oneDNN linear exists here and matches ``F.linear`` (checked once per process)."""
    global _checked
    with _lock:
        if _checked is None:
            _checked = False
            op = _op()
            if op is not None and torch.backends.mkldnn.is_available():
                try:
                    g = torch.Generator().manual_seed(0)
                    x, w, b = (torch.randn(s, generator=g) for s in ((3, 64), (96, 64), (96,)))
                    y = op(x, w, b, "none", [], "")
                    _checked = bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
                except (RuntimeError, TypeError):
                    _checked = False
        return _checked


@contextlib.contextmanager
def onednn() -> Iterator[None]:
    """Routed linears of this thread take the oneDNN op inside the block (nesting allowed)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_local, "depth", 0) and x.numel() and x.dtype == torch.float32 and not x.requires_grad:
        return _op()(x, self.weight, self.bias, "none", [], "")
    return F.linear(x, self.weight, self.bias)


def runner_linear(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``linear(x, weight)`` as the CPU runner computes it for weights of `dtype` (the oneDNN op for float32 with
    the fast path on, else ``F.linear``): what `cbnb.sim.calibrate` times, so the profile prices the engine's GEMMs."""
    op = _op()
    if dtype == torch.float32 and wanted() and available():
        return lambda x, w: op(x, w, None, "none", [], "")
    return F.linear


def route(model: torch.nn.Module) -> int:
    """Give the model's float32 CPU linears the oneDNN forward (idempotent); returns how many are routed.
    Routes nothing (returns 0) when the fast path is off or `available()` is False."""
    if not (wanted() and available()):
        return 0
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            if _MARK not in m.__dict__ and "forward" not in m.__dict__:
                m.forward = types.MethodType(_forward, m)
                m.__dict__[_MARK] = True
            n += _MARK in m.__dict__
    return n


def unroute(model: torch.nn.Module) -> None:
    """Give the model's linears back their class ``forward``."""
    for m in model.modules():
        if m.__dict__.pop(_MARK, None):
            m.__dict__.pop("forward", None)
