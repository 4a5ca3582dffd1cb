"""cbnb's compiled CPU kernels: paged attention in C (`paged_decode.c`), built on first use, then cached.

Why: a decode step of SmolLM2 on cpu-32 spent about a quarter of its time in 32 rows x 30 layers = 960 small
attention calls (each an OpenMP region plus a dozen view ops; under CPU contention every region also waits for both
cores). `paged_decode` computes all decode rows of a layer in one call, reading K/V in place from the pages.
`paged_prefill` does the same for the prefill chunks of a full-attention layer (causal, over the pages after the
chunk's K/V were written), where the torch path ran one attention call per chunk, gathered the pages of a chunk with
a past and computed its whole masked rectangle: a 512-token cpu-32 prefill step's attention 2.25 -> 1.17 ms per layer
(chunks of 180, 140, 92 fresh tokens and 100 over a past of 60; 2 threads, this project's EPYC, 2026-12-06, /tmp
microbenchmark of the attention alone).

Build: the system C compiler (``$CC``, else ``cc``) with ``-O3 -march=native -fopenmp``, once per source, flags
and CPU, into ``$CBNB_KERNEL_CACHE`` (default ``~/.cache/cbnb/kernels``); later processes load the cached library.
The library binds to the OpenMP runtime torch has already loaded (same soname), so it shares torch's threads.
Without a compiler, or when the build or load fails, `available()` is False once, with a warning, and the runner
uses its torch path. ``CBNB_CPU_KERNELS=0`` switches the kernel off (the "fast path off" of the oracle tests).
``CBNB_KERNEL_CFLAGS`` adds compiler flags to every C source's build (e.g. ``-mno-avx512f``: the AVX2 code on an
AVX-512 machine, to test and time what an AVX2-only CPU runs; the flags are part of the cached library's key).
The other C sources of the CPU fast path (`cbnb.runner.cpu.layer_ops`, `cbnb.runner.noise`) are built and loaded the
same way (`LazyLibrary`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["available", "enabled", "prefill_enabled", "paged_decode", "paged_prefill", "build_error", "build_library",
           "LazyLibrary"]

_SRC = Path(__file__).with_name("paged_decode.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
_LIBS = ["-lm"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64,
             ctypes.c_float, _PTR, _I64, _I64, _I64, ctypes.c_int]
_PREFILL_ARGTYPES = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                     _I64, _I64, ctypes.c_float, _PTR, _I64, _I64, ctypes.c_int]


def enabled() -> bool:
    """False when ``CBNB_CPU_KERNELS=0`` (read at every call, so tests can switch it per engine)."""
    return os.environ.get("CBNB_CPU_KERNELS", "1") not in ("0", "false", "off", "no")


def prefill_enabled() -> bool:
    """False when ``CBNB_CPU_PREFILL=0``: prefill rows take the torch attention path while decode rows keep the
    kernel (read at every step batch; the bench variant ``cpu_prefill=off|on``)."""
    return os.environ.get("CBNB_CPU_PREFILL", "1") not in ("0", "false", "off", "no")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    root = os.environ.get("CBNB_KERNEL_CACHE")
    return Path(root) if root else Path(os.path.expanduser("~/.cache/cbnb/kernels"))


def build_library(path: Path = _SRC, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile the C source `path` (with `extra` flags after the common ones) into a shared library, or load the copy
    cached for this source, compiler, flags and CPU. Raises RuntimeError without a compiler or when the build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    # The key covers the headers beside the source too (they are #included: cbnb_exp.h).
    src = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(path.parent.glob("*.h")))
    flags = [*_FLAGS, *extra, *os.environ.get("CBNB_KERNEL_CFLAGS", "").split()]
    key = hashlib.sha256(src + " ".join([cc, *flags, *_LIBS]).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = _cache_dir() / f"{path.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *flags, str(path), "-o", tmp, *_LIBS], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, out)  # atomic: concurrent builders never load a half-written file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(out))


class LazyLibrary:
    """A C source beside this module, built (`build_library`) and bound on its first use, once per process.

    `get()` returns what ``bind(library)`` returned (e.g. its functions with their ctypes signatures), or None with
    the CPU fast path off (`enabled`) or when the build, load or binding failed: then one RuntimeWarning says
    "cbnb: <what> is unavailable (<why>); <fallback>", `error` keeps the why, and later calls return None quietly.
    Thread-safe (one build even when several engines start at once).
    """

    def __init__(self, source: str, bind: Callable[[ctypes.CDLL], Any], what: str, fallback: str,
                 extra: tuple[str, ...] = ()) -> None:
        self.path = Path(__file__).with_name(source)
        self.bind, self.what, self.fallback, self.extra = bind, what, fallback, extra
        self.bound: Any = None
        self.error: str | None = None
        self.tried = False
        self._lock = threading.Lock()

    def get(self) -> Any:
        if not enabled():
            return None
        if not self.tried:
            with self._lock:
                if not self.tried:
                    try:
                        self.bound = self.bind(build_library(self.path, self.extra))
                    except Exception as e:  # no compiler, a failed build or load: the torch path serves instead
                        self.error = f"{type(e).__name__}: {e}"
                        warnings.warn(f"cbnb: {self.what} is unavailable ({self.error}); {self.fallback}",
                                      RuntimeWarning, stacklevel=3)
                    self.tried = True
        return self.bound


class _Paged:
    """The kernel library's two entry points, with their ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.decode, self.prefill = lib.cbnb_paged_decode_f32, lib.cbnb_paged_prefill_f32
        for fn, args in ((self.decode, _ARGTYPES), (self.prefill, _PREFILL_ARGTYPES)):
            fn.restype = ctypes.c_int
            fn.argtypes = args


_PAGED = LazyLibrary(_SRC.name, _Paged, "the CPU paged-attention kernel", "using the torch attention path")


def available() -> bool:
    """Whether the kernel is enabled and loaded (builds it on the first call; a failure warns once)."""
    return _PAGED.get() is not None


def build_error() -> str | None:
    """Why the kernel is unavailable (None when it loaded or was never tried)."""
    return _PAGED.error


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, rows: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, max_len: int, scale: float, out: torch.Tensor) -> None:
    """Decode attention of `rows` over their pages, written into `out` at the same rows.

    Args:
        q: ``[T, H, D]`` float32 CPU queries (last dim contiguous).
        k_pages, v_pages: the layer's pages ``[num_blocks, page_size, Hkv, D]`` float32 (last dim contiguous).
        rows: ``[B]`` int64 rows of `q` / `out` that decode.
        tables: ``[B, W]`` int64 block ids of each row (padded with any valid block).
        lens: ``[B]`` int64 keys per row (1 <= lens <= max_len <= W * page_size).
        max_len: the largest of `lens`.
        scale: softmax scale (usually head_dim ** -0.5).
        out: ``[T, H, D]`` float32, written at `rows` only.

    Raises:
        RuntimeError: the kernel is unavailable, or it rejected its arguments.
    """
    lib = _checked("paged_decode", q, k_pages, v_pages, out, (rows, tables, lens))
    T, H, D = q.shape
    _, page, hkv, _ = k_pages.shape
    B, W = tables.shape
    rc = lib.decode(q.data_ptr(), q.stride(0), q.stride(1), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.stride(0),
                    k_pages.stride(1), k_pages.stride(2), page, rows.data_ptr(), tables.data_ptr(), W, lens.data_ptr(),
                    B, H, hkv, D, float(scale), out.data_ptr(), out.stride(0), out.stride(1), int(max_len),
                    torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode rejected its arguments (code {rc}: H={H}, Hkv={hkv}, max_len={max_len})")


def paged_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, rows: torch.Tensor,
                  starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Causal attention of multi-token rows (prompt chunks) over their pages, written into `out` at their rows.

    Row b's queries are `q` rows ``rows[b] .. rows[b] + counts[b] - 1`` at positions ``starts[b] ..``; query i reads
    the row's keys ``0 .. starts[b] + i`` from its pages, which must already hold the chunk's own K/V (the runner
    writes them first). No sliding window (windowed layers keep the torch path).

    Args:
        q: ``[T, H, D]`` float32 CPU queries (last dim contiguous).
        k_pages, v_pages: the layer's pages ``[num_blocks, page_size, Hkv, D]`` float32 (last dim contiguous).
        rows, starts, counts: ``[B]`` int64: first query row, its position (the row's past, in tokens) and the
            chunk's length (>= 1).
        tables: ``[B, W]`` int64 block ids of each row, ``starts + counts <= W * page_size`` (padded with any
            valid block).
        scale: softmax scale (usually head_dim ** -0.5).
        out: ``[T, H, D]`` float32, written at the rows' queries only.

    Raises:
        RuntimeError: the kernel is unavailable, or it rejected its arguments (a count < 1, a table too short).
        ValueError: tensors of the wrong dtype, device or layout.
    """
    lib = _checked("paged_prefill", q, k_pages, v_pages, out, (rows, starts, counts, tables))
    T, H, D = q.shape
    _, page, hkv, _ = k_pages.shape
    B, W = tables.shape
    rc = lib.prefill(q.data_ptr(), q.stride(0), q.stride(1), k_pages.data_ptr(), v_pages.data_ptr(),
                     k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), page, rows.data_ptr(),
                     starts.data_ptr(), counts.data_ptr(), tables.data_ptr(), W, B, H, hkv, D, float(scale),
                     out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_prefill rejected its arguments (code {rc}: H={H}, Hkv={hkv}, B={B}, W={W})")


def _checked(name: str, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, out: torch.Tensor,
             index: tuple[torch.Tensor, ...]) -> _Paged:
    lib = _PAGED.bound if _PAGED.bound is not None else _PAGED.get()
    if lib is None:
        raise RuntimeError(f"the CPU paged-attention kernel is unavailable: {_PAGED.error}")
    for t in (q, k_pages, v_pages, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"{name} needs float32 CPU tensors with a contiguous last dimension")
    if v_pages.stride() != k_pages.stride() or v_pages.shape != k_pages.shape:
        raise ValueError(f"{name} needs K and V pages of the same shape and strides")
    for t in index:
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} needs contiguous int64 index tensors")
    return lib
