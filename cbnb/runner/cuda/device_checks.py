"""Checks of the CUDA path's environment: whether Triton can launch a kernel here, the attention the CUDA runner
picks from that, and a guard that makes host synchronisation inside a step visible.

Triton compiles a small C launcher with the host compiler (gcc) against Python's headers (``Python.h``) at the first
kernel launch, so an importable Triton can still fail at that moment; `triton_launch_check` launches a 1-element
kernel once per process and device to find out before a model runs. When it fails, the runner uses the kernels'
PyTorch references instead (slower, and without CUDA graphs, since they read metadata on the host) and says why in
``describe()["attention_reason"]``, rather than failing every step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from typing import Any, Callable, Iterator

import torch

from .triton_attention import HAS_TRITON, TRITON_ERROR, tl, triton

__all__ = ["triton_launch_check", "pick_attention", "build_tools", "sync_debug"]

_CHECKED: dict[str, tuple[bool, str]] = {}
_KERNEL: Any = None


def _add_one() -> Any:
    """The probe kernel, compiled on first use (so ``TRITON_INTERPRET`` is read when the check runs)."""
    global _KERNEL
    if _KERNEL is None:
        @triton.jit
        def add_one(x_ptr):
            tl.store(x_ptr, tl.load(x_ptr) + 1)

        _KERNEL = add_one
    return _KERNEL


def build_tools() -> dict[str, Any]:
    """What Triton's launcher build needs: the C compiler it would find and whether ``Python.h`` is installed."""
    inc = sysconfig.get_paths().get("include") or ""
    return {"cc": os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"),
            "gcc": shutil.which("gcc"), "python_h": os.path.exists(os.path.join(inc, "Python.h")),
            "python_include": inc}


def triton_launch_check(device: "str | torch.device") -> tuple[bool, str]:
    """Launch a 1-element Triton kernel on `device` (cached per process and device).

    Returns:
        (True, "") when it ran and wrote the right value, else (False, the reason: import error, launcher build or
        launch error, or a wrong result).
    """
    dev = torch.device(device)
    key = str(dev)
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    if not HAS_TRITON:
        res = (False, f"Triton is not importable: {TRITON_ERROR}")
    else:
        try:
            x = torch.zeros(1, dtype=torch.int32, device=dev)
            _add_one()[(1,)](x)
            got = int(x.cpu()[0])
            res = (True, "") if got == 1 else (False, f"a 1-element Triton kernel wrote {got} instead of 1")
        except Exception as e:  # compiler missing, Python.h missing, driver or PTX errors...
            tools = build_tools()
            res = (False, f"a 1-element Triton kernel failed to launch: {type(e).__name__}: {e} (C compiler: "
                          f"{tools['cc'] or 'none found'}, Python.h: {'present' if tools['python_h'] else 'missing'})")
    _CHECKED[key] = res
    return res


def pick_attention(device: torch.device, requested: str | None = None,
                   check: Callable[[torch.device], tuple[bool, str]] = triton_launch_check) -> tuple[str, str]:
    """The CUDA runner's attention for `device`: (``"triton"`` or ``"torch"``, why not Triton; "" when Triton).

    `requested` (or the environment variable ``CBNB_ATTENTION``) forces one; otherwise Triton on CUDA when
    `check` passes, the PyTorch references elsewhere.
    """
    requested = requested or os.environ.get("CBNB_ATTENTION") or None
    if requested is not None:
        if requested not in ("triton", "torch"):
            raise ValueError(f"attention (or CBNB_ATTENTION) must be 'triton' or 'torch'; got {requested!r}")
        return requested, "" if requested == "triton" else "requested"
    if device.type != "cuda":
        return "torch", f"no Triton kernels on device type {device.type!r} (the PyTorch references run instead)"
    ok, why = check(device)
    if ok:
        return "triton", ""
    return "torch", f"{why}; using the PyTorch reference attention (no CUDA graphs)"


@contextlib.contextmanager
def sync_debug(mode: "str | int | None") -> Iterator[None]:
    """Within the block, ``torch.cuda.set_sync_debug_mode(mode)`` ("warn" or "error": a host synchronisation warns
    or raises); the previous mode afterwards. Nothing without a mode or without CUDA."""
    if not mode or not torch.cuda.is_available():
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)
