"""Keep the engine thread's OpenMP team fast when other threads also run torch ops.

Why: torch's CPU ops run on GNU OpenMP (libgomp), which keeps a pool of worker threads per thread that ever ran a
parallel region. Once the notebook's main thread has run one torch op (``model.generate``, a tensor sum, a
microbenchmark), two pools exist, libgomp counts more of its threads than there are CPUs, and from then on its idle
workers sleep at once instead of spinning briefly: every parallel region of the engine thread pays a futex wake-up.
On the 2-core development machine (2 torch threads) that made `cpu-32` steps 18 % slower for the rest of the
process (median step 150 -> 178 ms after one ``model(ids)`` on the main thread, `cbnb.bench`-like runs, 2026-12-04),
and a loop of decode-sized GEMMs on a persistent thread 40 % slower; ``OMP_WAIT_POLICY=PASSIVE`` reproduces the slow
figure, and releasing the main thread's pool restores the fast one.

How: `release_caller_threads()` calls OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)`` in the calling thread:
libgomp frees that thread's idle pool (the next torch op there makes a new one, ~0.1 ms). It never touches another
thread's pool, and libgomp refuses it inside a parallel region. The engine calls it from `submit`/`start` on the
caller's thread and, in IPython, after every cell (``post_run_cell``). ``CBNB_OMP_RELEASE=0`` turns it off; off
libgomp (macOS' libomp, Windows, a non-OpenMP torch) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["release_caller_threads", "release_after_cells"]

_OMP_PAUSE_SOFT = 1
_lib: object = None  # None: not looked up yet; False: no libgomp here
_hook_lock = threading.Lock()
_hooked: set[int] = set()


def _libgomp():
    global _lib
    if _lib is None:
        _lib = False
        try:
            import torch

            if "OpenMP" not in torch.__config__.parallel_info():
                return _lib
            path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
            lib = ctypes.CDLL(path if os.path.exists(path) else "libgomp.so.1")
            fn = lib.omp_pause_resource_all
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _lib = fn
        except (OSError, AttributeError, ImportError):
            pass
    return _lib


def release_caller_threads() -> bool:
    """Free the calling thread's idle OpenMP worker threads (see the module docstring).

    Returns:
        True when libgomp released them (or the thread had none); False when it is off, not libgomp, or refused
        (called inside a parallel region).
    """
    if os.environ.get("CBNB_OMP_RELEASE", "1") in ("0", "false", "off", "no"):
        return False
    fn = _libgomp()
    return bool(fn) and fn(_OMP_PAUSE_SOFT) == 0


def release_after_cells() -> bool:
    """In IPython, release the main thread's pool after every cell (registered once per shell). Returns whether a
    shell is running (False outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    if ip is None or not hasattr(ip, "events"):
        return False
    with _hook_lock:
        if id(ip) not in _hooked:
            ip.events.register("post_run_cell", _after_cell)
            _hooked.add(id(ip))
    return True


def _after_cell(*_args: object) -> None:
    release_caller_threads()
