"""Counter-based Gumbel noise and a first-index argmax, the two kernels of `cbnb.runner.sampling`'s draw.

``U`` for (row, token) is a 31-bit integer hash of the row's 62-bit key and the token id (no generator state, so a
seeded sample depends on the request only); ``G = -log(-log U)``. `gumbel_noise` is the reference definition;
`_noise_into` computes the same values in place: on CPU its integer hash is one C pass (`noise.c`, built like the
decode kernel; about 26 int32 torch passes otherwise, 6 of a sampled cpu-32 step's 9 ms), else in int32 torch ops, a
chunk of rows at a time (an int32 multiply wraps, and its low 31 bits equal the int64 product's); the logs stay in
torch either way, so the values are the reference's bit for bit. `_argmax` returns the first index of each row's maximum, as
`torch.argmax`, in two vectorised passes (block maxima, then the first block holding the row's maximum).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from typing import Any

import torch

from .cpu import cpu_kernels

__all__ = ["gumbel_noise", "row_key"]

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B  # odd multiplier of a well-known 32-bit integer hash; products stay below 2**63 on 31-bit values
_SALT = 0x2545F491


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) with good avalanche (xorshift-multiply rounds, int64 without overflow)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    x = ((x ^ (x >> 16)) * _MUL) & _M31
    return x ^ (x >> 16)


def row_key(seed: int, index: int, ordinal: int | None = None) -> int:
    """The 62-bit noise key of one draw: the output token `index` of a request with `seed` (or, with `ordinal`, of
    the `ordinal`-th unseeded request under the engine seed `seed`)."""
    text = f"s:{seed}:{index}" if ordinal is None else f"e:{seed}:{ordinal}:{index}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


_TOKEN_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    key = (vocab, str(device))
    t = _TOKEN_HASH.get(key)
    if t is None:
        t = _TOKEN_HASH[key] = _mix31(torch.arange(vocab, dtype=torch.int64, device=device) ^ _SALT)
    return t


def gumbel_noise(key_lo: torch.Tensor, key_hi: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[S, vocab]`` (fp32) for rows with 31-bit key halves ``key_lo``/``key_hi`` ``[S, 1]``
    (int64, same device). Deterministic: equal keys give equal rows on any device. (The reference definition, in
    int64; the sampler computes the same values with `_noise_into`.)"""
    h = _mix31(_mix31(_token_hash(vocab, key_lo.device) ^ key_lo) ^ key_hi)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # (0, 1), exact in fp32
    return -torch.log(-torch.log(u))


_CHUNK = 1 << 18  # elements per chunk of the noise pass (its int32 scratch is reused chunk to chunk)


def _mix31_(h: torch.Tensor, t: torch.Tensor) -> None:
    """`_mix31` in place on int32 values in [0, 2**31), with scratch `t`. The product wraps modulo 2**32 in int32
    (two's complement, as torch's integer kernels do); its low 31 bits, all that ``& _M31`` keeps, are those of the
    exact int64 product, so the result equals `_mix31`'s (tests/runner/test_sampling_fast.py checks it)."""
    for _ in range(2):
        torch.bitwise_right_shift(h, 16, out=t)
        h.bitwise_xor_(t).mul_(_MUL).bitwise_and_(_M31)
    torch.bitwise_right_shift(h, 16, out=t)
    h.bitwise_xor_(t)


def _bind(lib: ctypes.CDLL) -> Any:
    fn = lib.cbnb_noise_uniform
    fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, i64, ctypes.c_int]
    return fn


_C = cpu_kernels.LazyLibrary("noise.c", _bind, "the C noise pass", "using torch")


def _c_uniform() -> Any:
    """The C noise pass (`noise.c`), or None: CPU fast path off (``CBNB_CPU_KERNELS=0``) or no compiler (warns once)."""
    return _C.get()


def _noise_into(out: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, ws: dict | None = None) -> torch.Tensor:
    """`gumbel_noise` written into ``out [S, V]`` (fp32, contiguous), the same values: on CPU the integer hash in
    one C pass, else int32 in place, a few rows at a time (an int64 pass over the whole block allocated ~20 tensors
    of ``S * V * 8`` bytes)."""
    S, V = out.shape
    th = _token_hash(V, out.device).to(torch.int32)
    lo, hi = key_lo.to(torch.int32), key_hi.to(torch.int32)
    fn = _c_uniform() if out.device.type == "cpu" and out.is_contiguous() and S and V else None
    if fn is not None:
        lo, hi = lo.reshape(-1).contiguous(), hi.reshape(-1).contiguous()
        if fn(out.data_ptr(), th.data_ptr(), lo.data_ptr(), hi.data_ptr(), S, V, torch.get_num_threads()) == 0:
            return out.log_().neg_().log_().neg_()  # u in (0, 1), then -log(-log u), in torch as the reference
    per = max(1, min(S, _CHUNK // max(V, 1)))
    h = _scratch(ws, "noise_h", (per, V), out, torch.int32)
    t = _scratch(ws, "noise_t", (per, V), out, torch.int32)
    for r0 in range(0, S, per):
        r1 = min(S, r0 + per)
        hh, tt = h[: r1 - r0], t[: r1 - r0]
        torch.bitwise_xor(th, lo[r0:r1], out=hh)
        _mix31_(hh, tt)
        hh.bitwise_xor_(hi[r0:r1])
        _mix31_(hh, tt)
        o = out[r0:r1]
        o.copy_(hh.bitwise_right_shift_(8))
        o.add_(0.5).mul_(1.0 / (1 << 23)).log_().neg_().log_().neg_()  # u in (0, 1), then -log(-log u)
    return out


def _scratch(ws: dict | None, name: str, shape: tuple[int, ...], like: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """A reusable buffer of `shape` from the workspace `ws` (grown as needed; a fresh tensor when `ws` is None):
    large tensors freshly allocated each step cost page faults on CPU."""
    dtype = dtype or like.dtype
    size = math.prod(shape)
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    t = ws.get(name)
    if t is None or t.numel() < size or t.dtype != dtype or t.device != like.device:
        t = ws[name] = torch.empty(size, dtype=dtype, device=like.device)
    return t[:size].view(shape)


_BLOCK = 64


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for ``x [n, V]`` (fp32), the first index of each row's maximum, in two vectorised passes:
    block maxima (a fast reduction), then the first block holding the row's maximum and the first index in it
    (torch's argmax is a scalar loop, ~8x slower on CPU). Rows with NaN get an arbitrary index (such rows fail:
    their maximum is not finite)."""
    n, V = x.shape
    if x.device.type != "cpu" or V % _BLOCK or V < 4 * _BLOCK or not x.is_contiguous():
        return x.argmax(-1)
    blocks = x.view(n, V // _BLOCK, _BLOCK)
    bmax = blocks.amax(-1)  # [n, nb]
    first = (bmax == bmax.amax(-1, keepdim=True)).to(torch.uint8).argmax(-1)  # first block with the maximum
    inner = blocks[torch.arange(n, device=x.device), first].argmax(-1)  # [n, _BLOCK] -> first index in it
    return first * _BLOCK + inner
