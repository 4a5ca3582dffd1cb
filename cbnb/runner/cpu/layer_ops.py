"""CPU layer ops in C (`layer_ops.c`) for the runner's decoder-layer forward (`cbnb.runner.cpu.cpu_layers`): rotary
embedding of q and k, the K/V write into the cache's rows, RMSNorm with the residual add fused in, SiLU * up.

Why: in eager torch each is several ATen ops (transformers' rotary about 16 on strided ``[1, H, T, D]`` views,
RMSNorm 7), and on a 2-core CPU the ops cost more than their arithmetic: SmolLM2's rotary took 48 us per layer at 32
rows and 220-670 us at 512 rows, RMSNorm 26 / 90 us, against 17 / 51 us and 8 / 32 us here (2026-12-06, the
project's EPYC, 2 threads; per call, Python included). Each op is one C pass over the rows.

Numbers: the rotary (its products and sum rounded as torch rounds them: built with ``-ffp-contract=off``), the
residual add and the K/V write give the same bits as the torch code they replace; RMSNorm (another summation order)
and SiLU (its own exp, `cbnb_exp.h`) agree with torch to float32 rounding, like the decode kernel.

Built like the decode kernel (`cbnb.runner.cpu.cpu_kernels.build_library`); ``CBNB_CPU_KERNELS=0`` turns them off with
the rest of the CPU fast path, and without a compiler `available()` is False (with one warning) and the runner
keeps transformers' forward.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_kernels

__all__ = ["available", "rope_qk", "write_kv", "rms_norm", "silu_mul"]

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_F32 = torch.float32


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, args in (
            ("cbnb_rope_qk_f32", [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                  ctypes.c_int]),
            ("cbnb_write_kv_f32", [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]),
            ("cbnb_add_rms_norm_f32", [_PTR, _I64, _PTR, _I64, _PTR, ctypes.c_float, _PTR, _PTR, _I64, _I64,
                                       ctypes.c_int]),
            ("cbnb_silu_mul_f32", [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, ctypes.c_int])):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = args
    return lib


# -ffp-contract=off: no fused multiply-add, so the rotary rounds as torch does (module docstring).
_LIB = cpu_kernels.LazyLibrary("layer_ops.c", _bind, "the CPU layer ops", "using torch ops",
                               extra=("-ffp-contract=off",))


def available() -> bool:
    """Whether the ops are enabled (the CPU fast path, `cpu_kernels.enabled`) and loaded (built on the first call;
    a failure warns once)."""
    return _LIB.get() is not None


def _lib() -> ctypes.CDLL:
    lib = _LIB.bound if _LIB.bound is not None else _LIB.get()
    if lib is None:
        raise RuntimeError(f"the CPU layer ops are unavailable: {_LIB.error}")
    return lib


def _rows_ok(t: torch.Tensor, width: int) -> bool:
    """A float32 CPU ``[T, width]`` tensor whose rows are contiguous (any row stride). Cheap: called per layer."""
    return t.dtype is _F32 and t.is_cpu and t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of q and k, as transformers' ``apply_rotary_pos_emb`` computes it (rotate_half form,
    ``x * cos + rotate_half(x) * sin``), bit for bit.

    Args:
        q: ``[T, num_heads * D]`` float32 (rows may be strided, e.g. a slice of a fused projection).
        k: ``[T, num_kv_heads * D]`` float32, likewise.
        cos, sin: ``[T, D]`` float32 with contiguous rows (the model's rotary ``position_embeddings``, batch dim
            removed).

    Returns:
        (q, k) rotated, new contiguous tensors ``[T, num_heads, D]`` and ``[T, num_kv_heads, D]``.

    Raises:
        ValueError: a shape, dtype or layout the op does not take (callers check `available()` first).
    """
    lib = _lib()
    T, D = cos.shape
    if not (_rows_ok(q, num_heads * D) and _rows_ok(k, num_kv_heads * D) and _rows_ok(cos, D) and _rows_ok(sin, D)
            and q.shape[0] == k.shape[0] == sin.shape[0] == T and sin.stride(0) == cos.stride(0) and D % 2 == 0):
        raise ValueError(f"rope_qk: unsupported shapes/layout q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"cos {tuple(cos.shape)} (float32 CPU rows, even head size)")
    qo = torch.empty(T, num_heads, D)
    ko = torch.empty(T, num_kv_heads, D)
    if T:
        rc = lib.cbnb_rope_qk_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), cos.data_ptr(),
                                   sin.data_ptr(), cos.stride(0), qo.data_ptr(), ko.data_ptr(), T, num_heads,
                                   num_kv_heads, D, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rope_qk rejected its arguments (code {rc})")
    return qo, ko


def write_kv(rows: torch.Tensor, slots: torch.Tensor, k_base: int, v_base: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``rows[slots + k_base] = k`` and ``rows[slots + v_base] = v``, row by row in token order (what two
    ``index_copy_`` calls do for distinct slots).

    Args:
        rows: ``[N, W]`` contiguous float32 (the cache pool's token rows).
        slots: ``[T]`` contiguous int64 token rows.
        k, v: ``[T, W]`` float32 with contiguous rows (any row stride).

    Raises:
        IndexError: a target row outside ``[0, N)`` (nothing is written).
        ValueError: a dtype or layout the op does not take.
    """
    lib = _lib()
    n, w = rows.shape
    T = slots.shape[0]
    if not (rows.is_contiguous() and _rows_ok(rows, w) and _rows_ok(k, w) and _rows_ok(v, w)
            and k.shape[0] == v.shape[0] == T and slots.dtype == torch.int64 and slots.is_contiguous()):
        raise ValueError("write_kv needs contiguous float32 rows [N, W], k and v [T, W] and int64 slots [T]")
    rc = lib.cbnb_write_kv_f32(rows.data_ptr(), n, w, slots.data_ptr(), T, int(k_base), int(v_base), k.data_ptr(),
                                k.stride(0), v.data_ptr(), v.stride(0))
    if rc == 2:
        raise IndexError(f"write_kv: a slot + base is outside the {n} cache rows")
    if rc != 0:
        raise ValueError(f"write_kv rejected its arguments (code {rc})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm (``weight * x / sqrt(mean(x ** 2) + eps)``, row by row), with the residual add fused in
    when `residual` is given: ``s = residual + x`` (the same bits as torch's add), then the norm of ``s``.

    Args:
        x, residual: ``[T, n]`` float32 with contiguous rows (any row stride).
        weight: ``[n]`` contiguous float32.

    Returns:
        (s, normed): ``s`` is ``residual + x`` (a new ``[T, n]`` tensor), or `x` itself without a residual;
        ``normed`` a new ``[T, n]`` tensor, equal to torch's to float32 rounding (the sum's order differs).

    Raises:
        ValueError: a shape, dtype or layout the op does not take.
    """
    lib = _lib()
    T, n = x.shape
    if not (_rows_ok(x, n) and weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape == (n,)
            and (residual is None or (_rows_ok(residual, n) and residual.shape[0] == T))):
        raise ValueError(f"rms_norm: unsupported shapes/layout x {tuple(x.shape)} weight {tuple(weight.shape)}")
    y = torch.empty(T, n)
    s = x if residual is None else torch.empty(T, n)
    if T:
        a, b = (x, None) if residual is None else (residual, x)
        rc = lib.cbnb_add_rms_norm_f32(a.data_ptr(), a.stride(0), None if b is None else b.data_ptr(),
                                        0 if b is None else b.stride(0), weight.data_ptr(), float(eps),
                                        None if b is None else s.data_ptr(), y.data_ptr(), T, n,
                                        torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rms_norm rejected its arguments (code {rc})")
    return s, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the gated MLP's activation), equal to torch's to float32 rounding.

    Args:
        gate, up: ``[T, n]`` float32 with contiguous rows (any row stride: slices of one fused projection).

    Returns:
        A new ``[T, n]`` tensor.

    Raises:
        ValueError: a shape, dtype or layout the op does not take.
    """
    lib = _lib()
    T, n = gate.shape
    if not (_rows_ok(gate, n) and _rows_ok(up, n) and up.shape[0] == T):
        raise ValueError(f"silu_mul: unsupported shapes/layout gate {tuple(gate.shape)} up {tuple(up.shape)}")
    y = torch.empty(T, n)
    if T:
        rc = lib.cbnb_silu_mul_f32(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), y.data_ptr(), T, n,
                                    torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"silu_mul rejected its arguments (code {rc})")
    return y
