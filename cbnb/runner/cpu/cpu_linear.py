"""The CPU runner's linear layers through oneDNN, on prepacked weights, with sibling projections fused.

Why: on the project's AMD EPYC machine, float32 ``F.linear`` (MKL) with few rows is far from the memory bandwidth it
should reach: SmolLM2's LM head (49,152 x 576) took 12 ms for 1 row and 38 ms for 3 rows, against 6.6 and 7.4 ms
through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the op torch's inductor compiles CPU linears to).
Given a plain weight, oneDNN reorders it into its blocked layout at every call; a weight reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does) skips that: SmolLM2's 30 layers
at 32 rows took 25.1 -> 19.7 ms, its LM head 12.8 -> 9.3 ms (2026-12-06, this EPYC, 2 threads, fastest of 3).
A decode step is mostly these GEMMs. Sibling projections that read the same input (``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj``) run as one GEMM over their concatenated weights, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: fewer, wider calls (30 layers at 1 row: 24.2 -> 19.6 ms).

How: `route(model)` gives every float32 CPU ``nn.Linear`` of the model its own ``forward`` that takes the oneDNN
path only while `onednn()` is active in the calling thread (the runner's eager forward); anywhere else (the user's
own ``model.generate``, another thread) the module computes ``F.linear`` on its own weight as before. The packed
copies live beside the model's weights (about as many bytes again; `packed_bytes`) from `route` until `unroute`,
and a weight changed in place or replaced is packed again at its next call. In a fused group, the first member
called with an input computes every member's output; the others, called with the same tensor, take theirs (a
member called with another input computes alone). ``CBNB_CPU_KERNELS=0`` turns all of it off with the decode
kernel (the "fast path off" of the oracle tests); ``CBNB_ONEDNN_LINEAR=0`` turns off this part alone,
``CBNB_PACKED_LINEAR=0`` the packing and fusion only (oneDNN on plain weights; half the memory).
`available()` is False, once, when this torch has no oneDNN linear or its result differs from ``F.linear`` beyond
float32 rounding; the runner then keeps ``F.linear``.
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

__all__ = ["available", "wanted", "packing", "gemv", "onednn", "route", "unroute", "runner_linear", "fused_groups",
           "group_output", "sibling_outputs", "packed_bytes", "bytes_to_pack"]

_local = threading.local()
_checked: dict[str, bool] = {}
_lock = threading.Lock()
_MARK = "_cbnb_linear"
_PACK = "_cbnb_pack"  # module.__dict__: _Pack of its own weight
_GROUP = "_cbnb_group"  # module.__dict__: (_Group, index in the group)
#: Sibling projections that read the same input, fused when all of a set are plain linears of one parent.
FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: The row count the packed layout is chosen for (oneDNN's hint; measured as fast from 1 to 512 rows).
_PACK_ROWS = 512


def _op():
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def _reorder():
    return getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)


def _off(name: str) -> bool:
    return os.environ.get(name, "1") in ("0", "false", "off", "no")


def wanted() -> bool:
    """The CPU fast path is on and ``CBNB_ONEDNN_LINEAR`` is not 0 (read at every call, like `enabled`)."""
    return enabled() and not _off("CBNB_ONEDNN_LINEAR")


def packing() -> bool:
    """`wanted` and ``CBNB_PACKED_LINEAR`` is not 0, and this torch packs weights correctly (`available`)."""
    return wanted() and not _off("CBNB_PACKED_LINEAR") and available("packed")


def available(kind: str = "plain") -> bool:
    """Whether torch's oneDNN linear exists here and matches ``F.linear`` (checked once per process), on plain
    weights (`kind` "plain") or on weights packed by ``_reorder_linear_weight`` ("packed")."""
    with _lock:
        if kind not in _checked:
            _checked[kind] = False
            op, reorder = _op(), _reorder()
            if op is not None and torch.backends.mkldnn.is_available() and (kind == "plain" or reorder is not None):
                try:
                    g = torch.Generator().manual_seed(0)
                    x, w, b = (torch.randn(s, generator=g) for s in ((3, 64), (96, 64), (96,)))
                    wp = w if kind == "plain" else reorder(w, _PACK_ROWS)
                    y = op(x, wp, b, "none", [], "")
                    _checked[kind] = bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
                except (RuntimeError, TypeError):
                    _checked[kind] = False
        return _checked[kind]


@contextlib.contextmanager
def onednn() -> Iterator[None]:
    """Routed linears of this thread take the oneDNN op inside the block (nesting allowed). Fused outputs not yet
    taken are dropped when the outermost block ends."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.gemv = gemv()  # read once per forward, not per linear
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.stash = {}


class _Pack:
    """A weight (or several, concatenated by rows) in oneDNN's layout, valid while the sources are unchanged."""

    __slots__ = ("weight", "bias", "sources", "versions", "nbytes")

    def __init__(self, sources: list[torch.nn.Linear]) -> None:
        self.sources = [(m.weight, m.bias) for m in sources]
        self.versions = self._versions()
        w = sources[0].weight if len(sources) == 1 else torch.cat([m.weight for m in sources])
        self.weight = _reorder()(w.detach(), _PACK_ROWS)
        biases = [m.bias for m in sources]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]) if len(biases) > 1 \
            else biases[0]
        self.nbytes = w.numel() * w.element_size()

    def _versions(self) -> tuple:
        return tuple(t._version for w, b in self.sources for t in (w, b) if t is not None)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` through oneDNN on the packed weight."""
        return _op()(x, self.weight, self.bias, "none", [], "")

    def fresh(self, modules: list[torch.nn.Linear]) -> bool:
        return all(m.weight is w and m.bias is b for m, (w, b) in zip(modules, self.sources)) \
            and self._versions() == self.versions


class _Group:
    """Sibling linears computed by one GEMM (`FUSABLE`)."""

    __slots__ = ("members", "sizes", "pack")

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.pack = _Pack(members)

    def packed(self) -> _Pack:
        if not self.pack.fresh(self.members):
            with _lock:
                if not self.pack.fresh(self.members):
                    self.pack = _Pack(self.members)
        return self.pack

    def call(self, i: int, x: torch.Tensor) -> torch.Tensor:
        stash = getattr(_local, "stash", None)
        if stash is None:
            stash = _local.stash = {}
        held = stash.get(id(self))
        if held is not None and held[0] is x and i in held[1]:
            out = held[1].pop(i)
            if not held[1]:
                del stash[id(self)]
            return out
        parts = self.packed().linear(x).split(self.sizes, dim=-1)
        stash[id(self)] = (x, {j: t for j, t in enumerate(parts) if j != i})
        return parts[i]


def _own_pack(m: torch.nn.Linear) -> _Pack:
    p = m.__dict__.get(_PACK)
    if p is None or not p.fresh([m]):
        with _lock:
            p = m.__dict__.get(_PACK)
            if p is None or not p.fresh([m]):
                p = m.__dict__[_PACK] = _Pack([m])
    return p


def gemv() -> bool:
    """A linear over one row (a lone request's decode step) takes ``F.linear`` (torch's BLAS), unless
    ``CBNB_MKL_GEMV`` is 0. Measured on a 2-core Sapphire Rapids Xeon (2026-12-07): SmolLM2-135M's 1-row decode
    forward took 33-37 ms against 47-61 ms through oneDNN (its packed layout is chosen for many rows), equal from
    4 rows up. Not measured on an AVX2-only machine."""
    return not _off("CBNB_MKL_GEMV")


def _one_row(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1] and getattr(_local, "gemv", True)


def _onednn_input(x: torch.Tensor) -> bool:
    """A routed linear takes the oneDNN path for `x`: inside the runner's forward (`onednn`), float32, no grad, not one
    row (`gemv`)."""
    return bool(getattr(_local, "depth", 0) and x.numel() and x.dtype == torch.float32 and not x.requires_grad
                and not _one_row(x))


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _onednn_input(x):
        d = self.__dict__
        if _GROUP in d:
            g, i = d[_GROUP]
            return g.call(i, x)
        if _PACK in d:
            return _own_pack(self).linear(x)
        return _op()(x, self.weight, self.bias, "none", [], "")
    return F.linear(x, self.weight, self.bias)


def group_output(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The output of the whole fused group whose first member is `m` (`fused_groups`): ``[..., sum of the members'
    out_features]``, member i's output being its slice in group order, computed by the one GEMM the members' own
    forwards would share (the same bits). None where those forwards would not fuse (outside the runner's forward,
    one row, `m` leads no group) or where a member has forward hooks (they must see their own call): then call the
    members. Saves the CPU decoder-layer forward (`cbnb.runner.cpu.cpu_layers`) a module call per extra member."""
    gi = m.__dict__.get(_GROUP)
    if gi is None or gi[1] != 0 or not _onednn_input(x):
        return None
    g = gi[0]
    if _hooks() or any(h._forward_hooks or h._forward_pre_hooks for h in g.members):
        return None
    return g.packed().linear(x)


def sibling_outputs(members: list[torch.nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of sibling projections `members` (one `FUSABLE` set, in its order) for the input `x`: slices of
    their one fused GEMM (`group_output`) where the runner fuses them, else each module's own call."""
    gi = members[0].__dict__.get(_GROUP)
    out = group_output(members[0], x) if gi is not None and gi[0].members == members else None
    if out is None:
        return tuple(m(x) for m in members)
    return out.split(gi[0].sizes, dim=-1)


def _hooks() -> bool:
    """Whether global module hooks are registered (`torch.nn.modules.module.register_module_forward_hook`)."""
    mod = torch.nn.modules.module
    return bool(getattr(mod, "_global_forward_hooks", None) or getattr(mod, "_global_forward_pre_hooks", None))


def _routable(m: torch.nn.Module) -> bool:
    return type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


def fused_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The sibling sets of `FUSABLE` in `model` whose members are routable linears with one input size and
    biases on all or none (the GEMMs the CPU runner fuses)."""
    out = []
    for parent in model.modules():
        for names in FUSABLE:
            ms = [getattr(parent, n, None) for n in names]
            if all(m is not None and _routable(m) for m in ms) \
                    and len({m.in_features for m in ms}) == 1 and len({m.bias is None for m in ms}) == 1:
                out.append(ms)
    return out


def runner_linear(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``linear(x, weight)`` as the CPU runner computes it for weights of `dtype` (the oneDNN op for float32 with
    the fast path on, on a packed copy of each weight made at its first call while packing is on; ``F.linear`` for
    one row while `gemv` is on, and else): what `cbnb.measure.calibrate` and the bench's roofline probe time, so they
    price the engine's GEMMs. The packed copies live as long as the returned function."""
    op = _op()
    if not (dtype == torch.float32 and wanted() and available()):
        return F.linear
    one_row = gemv()
    if not packing():
        def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if one_row and x.numel() == x.shape[-1]:
                return F.linear(x, w)  # as the engine's 1-row linears (`gemv`)
            return op(x, w, None, "none", [], "")

        return plain
    reorder = _reorder()
    packs: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if one_row and x.numel() == x.shape[-1]:
            return F.linear(x, w)  # as the engine's 1-row linears (`gemv`)
        held = packs.get(id(w))
        if held is None or held[0] is not w or held[1] != w._version:
            held = packs[id(w)] = (w, w._version, reorder(w.detach(), _PACK_ROWS))
        return op(x, held[2], None, "none", [], "")

    return linear


def route(model: torch.nn.Module) -> int:
    """Give the model's float32 CPU linears the oneDNN forward (idempotent); returns how many are routed.
    With `packing()`, also packs their weights and fuses the `fused_groups`. Routes nothing (returns 0) when the
    fast path is off or `available()` is False."""
    if not (wanted() and available()):
        return 0
    pack = packing()
    if pack:
        for ms in fused_groups(model):
            if any(_MARK not in m.__dict__ and "forward" in m.__dict__ for m in ms):
                continue  # a member with a forward of someone else's: leave the set alone
            if not all(_GROUP in m.__dict__ for m in ms):
                g = _Group(ms)
                for i, m in enumerate(ms):
                    m.__dict__[_GROUP] = (g, i)
    n = 0
    for m in model.modules():
        if _routable(m):
            if _MARK not in m.__dict__ and "forward" not in m.__dict__:
                m.forward = types.MethodType(_forward, m)
                m.__dict__[_MARK] = True
                if pack and _GROUP not in m.__dict__:
                    _own_pack(m)
            n += _MARK in m.__dict__
    return n


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weight copies `route` made for `model` (0 when none)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        d = m.__dict__
        items = [d[_PACK]] if _PACK in d else []
        if _GROUP in d:
            items.append(d[_GROUP][0].pack)
        for p in items:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.nbytes
    return total


def bytes_to_pack(model: torch.nn.Module) -> int:
    """Bytes `route` would add to `model` now: its routable linears' weights when packing is on, less the copies it
    already has (what the CPU cache sizing reserves before the runner packs)."""
    if not packing():
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if _routable(m))
    return max(need - packed_bytes(model), 0)


def unroute(model: torch.nn.Module) -> None:
    """Give the model's linears back their class ``forward`` and drop the packed copies."""
    for m in model.modules():
        m.__dict__.pop(_PACK, None)
        m.__dict__.pop(_GROUP, None)
        if m.__dict__.pop(_MARK, None):
            m.__dict__.pop("forward", None)
