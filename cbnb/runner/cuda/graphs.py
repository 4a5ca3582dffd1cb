"""CUDA graphs for the CUDA runner: padding arithmetic, padded step shapes and their keys, the packed metadata layout,
static IO buffers, and a graph cache over a capture/replay backend (a real CUDA one and a fake one for CPU tests).

Padding (transformers' presets and semantics, reference sections 7-8):

- ``pad_to_interval(n, i, cap)``: n rounded up to a multiple of i, with **0 padded to one full interval**, capped at
  ``cap``;
- varlen steps (any chunk of 2+ tokens): query tokens padded to a multiple of ``q_padding_interval_size`` (preset 64),
  capped at ``max_batch_tokens``; sequence slots ``min(padded tokens, max_requests_per_batch)``;
- decode steps (every request has one query token): requests padded to the next power of two, capped at
  ``max_requests_per_batch`` (transformers' decode fast path);
- both: the longest request's KV length padded to a multiple of ``kv_padding_interval_size`` (preset 16384), capped at
  the largest KV length a request can have. cbnb's kernels read pages in place, so what the shape fixes is the
  **block-table width** (and the decode split count), not a gather buffer: transformers pads the total tokens read
  (its read index), cbnb the per-request maximum.

The graph key is ``(kind, padded query tokens, padded KV length)``; everything else in the shape (sequence slots,
prefill work-list entries, table widths, decode splits) is a function of it. Padded rows have input id 0, position
0, write their K/V to the write-padding block, belong to no sequence (so attention reads nothing for them and nothing
real reads them) and are never sampled (logits rows of padded sample slots point at row 0 and are ignored).

A cache miss warms up with *neutral* metadata (every row padded: the real cache is untouched, Triton kernels compile,
the allocator warms), captures (nothing runs during a capture), then replays; a hit replays. Captures and replays are
counted (`GraphCache.captures` / `.replays`). Graphs bind static addresses, so each IO pair has its own graphs (the pair
index is part of the cache key) and all graphs share one memory pool.

A capture that fails (the forward raises inside it, or the capture is invalidated, e.g. by a host synchronisation)
ends the capture, keeps the original error as a `GraphCaptureError` naming the key (`GraphCache.failures`, counted in
`.capture_failures`), and that shape runs eagerly from then on: the step that hit the failure included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...core.sampling_params import MAX_LOGPROBS

__all__ = [
    "pad_to_interval", "next_pow2", "cdiv", "StepShape", "ShapePlanner", "MetaLayout", "IOPair",
    "GraphBackend", "CudaGraphBackend", "FakeGraphBackend", "GraphCache", "GraphCaptureError", "capture_into",
    "graph_support",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_to_interval(n: int, interval: int, cap: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``interval`` (0 -> one interval), at most ``cap`` (but never below ``n``)."""
    if interval <= 0:
        raise ValueError(f"interval must be > 0; got {interval}")
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    p = max(1, cdiv(n, interval)) * interval
    if cap is not None:
        p = max(n, min(p, cap))
    return p


def next_pow2(n: int, cap: int | None = None) -> int:
    """The smallest power of two >= max(n, 1), at most ``cap`` (but never below ``n``)."""
    p = 1 << max(0, (max(n, 1) - 1).bit_length())
    if cap is not None:
        p = max(n, min(p, cap))
    return p


@dataclass(frozen=True)
class StepShape:
    """The (padded or exact) shape of one step's static inputs.

    Attributes:
        kind: "decode" (every request has one query token) or "varlen".
        num_tokens: query rows T.
        num_seqs: sequence slots R (also the logits rows kept).
        kv_len: per-request KV length bound (tokens); sets the full-attention table width.
        num_tiles: prefill work-list entries (0: no prefill kernel).
        num_dec: decode-list entries (0: no decode kernel).
        widths: block-table width per layer group.
        splits: decode KV splits per layer group.
        padded: True for a graph shape (padded), False for an exact eager shape.
    """

    kind: str
    num_tokens: int
    num_seqs: int
    kv_len: int
    num_tiles: int
    num_dec: int
    widths: tuple[int, ...]
    splits: tuple[int, ...]
    padded: bool

    @property
    def key(self) -> tuple:
        """The graph key: everything else in a padded shape is a function of it."""
        return (self.kind, self.num_tokens, self.kv_len)


class ShapePlanner:
    """Turns a step's real sizes into a `StepShape`.

    Args:
        q_interval, kv_interval: resolved padding intervals (> 0).
        max_tokens: ``max_batch_tokens``; max_seqs: ``max_requests_per_batch``.
        kv_cap: the largest KV length one request can have (tokens).
        page_size: tokens per page.
        windows: per layer group, the sliding window (0 for full attention).
        num_kv_heads: KV heads (for the decode split count); num_sms: multiprocessors of the device.
        block_m: prefill rows per work-list entry.
        split_fn: ``(num_seqs, num_kv_heads, kv_len, num_sms) -> splits``.
    """

    def __init__(self, *, q_interval: int, kv_interval: int, max_tokens: int, max_seqs: int, kv_cap: int,
                 page_size: int, windows: Sequence[int], num_kv_heads: int, num_sms: int, block_m: int,
                 split_fn: Callable[[int, int, int, int], int]) -> None:
        if q_interval <= 0 or kv_interval <= 0:
            raise ValueError("padding intervals must be resolved (> 0) before planning shapes")
        self.q_interval = q_interval
        self.kv_interval = kv_interval
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.kv_cap = kv_cap
        self.page_size = page_size
        self.windows = tuple(int(w) for w in windows)
        self.num_kv_heads = num_kv_heads
        self.num_sms = num_sms
        self.block_m = block_m
        self.split_fn = split_fn
        self._cache: dict[tuple, StepShape] = {}

    def _derived(self, kv_len: int, num_seqs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        P = self.page_size
        widths = tuple(cdiv(w, P) if w > 0 else cdiv(kv_len, P) for w in self.windows)
        splits = tuple(self.split_fn(num_seqs, self.num_kv_heads, min(w, kv_len) if w > 0 else kv_len, self.num_sms)
                       for w in self.windows)
        return widths, splits

    def plan(self, *, num_tokens: int, num_seqs: int, max_kv: int, decode_only: bool, pad: bool,
             num_tiles: int = 0, num_dec: int = 0) -> StepShape:
        """The shape of a step with `num_tokens` query tokens over `num_seqs` requests, the longest reading `max_kv`
        tokens. With `pad`, the padded (graph) shape; otherwise the exact one (`num_tiles`, `num_dec` given)."""
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_seqs} requests exceeds max_batch_tokens="
                             f"{self.max_tokens} / max_requests_per_batch={self.max_seqs}")
        if max_kv > self.kv_cap:
            raise ValueError(f"KV length {max_kv} exceeds the per-request cap {self.kv_cap}")
        if not pad:
            widths, splits = self._derived(max_kv, num_seqs)
            return StepShape("decode" if decode_only else "varlen", num_tokens, num_seqs, max_kv, num_tiles, num_dec,
                             widths, splits, False)
        kv = pad_to_interval(max_kv, self.kv_interval, self.kv_cap)
        ck = (decode_only, num_seqs if decode_only else num_tokens, kv)
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        self._cache[ck] = shape = self._padded(num_tokens, num_seqs, kv, decode_only)
        return shape

    def _padded(self, num_tokens: int, num_seqs: int, kv: int, decode_only: bool) -> StepShape:
        if decode_only:
            r = next_pow2(num_seqs, self.max_seqs)
            widths, splits = self._derived(kv, r)
            return StepShape("decode", r, r, kv, 0, r, widths, splits, True)
        t = pad_to_interval(num_tokens, self.q_interval, self.max_tokens)
        r = min(t, self.max_seqs)
        widths, splits = self._derived(kv, r)
        return StepShape("varlen", t, r, kv, cdiv(t, self.block_m) + r, r, widths, splits, True)

    def max_shape(self) -> StepShape:
        """A shape at least as large, segment by segment, as any shape `plan` returns (sizes the static buffers)."""
        widths, splits = self._derived(self.kv_cap, self.max_seqs)
        return StepShape("varlen", self.max_tokens, self.max_seqs, self.kv_cap,
                         cdiv(self.max_tokens, self.block_m) + self.max_seqs, self.max_seqs, widths, splits, True)


#: Columns of the sampler's report per row at most: a finiteness flag, a logprob, and K ids and K logprobs.
REPORT_COLUMNS = 2 + 2 * MAX_LOGPROBS
_ALIGN = 16  # int32 elements (64 bytes) per segment boundary


@dataclass
class MetaLayout:
    """Offsets of each int32 segment of the packed metadata of one shape (host and device use the same layout).

    Segments: ``ids``, ``pos``, ``carry`` [T]; ``logits_idx``, ``q_start``, ``q_len``, ``past`` [R]; ``dec_seq``
    [num_dec]; ``tile_seq``, ``tile_m0`` [num_tiles]; per group ``slots{g}`` [T] and ``table{g}`` [R, width].
    """

    segments: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    total: int = 0
    _sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_shape(cls, shape: StepShape) -> "MetaLayout":
        lay = cls()
        T, R = shape.num_tokens, shape.num_seqs
        for name, dims in [("ids", (T,)), ("pos", (T,)), ("carry", (T,)), ("logits_idx", (R,)), ("q_start", (R,)),
                           ("q_len", (R,)), ("past", (R,)), ("dec_seq", (shape.num_dec,)),
                           ("tile_seq", (shape.num_tiles,)), ("tile_m0", (shape.num_tiles,))]:
            lay._add(name, dims)
        for g, w in enumerate(shape.widths):
            lay._add(f"slots{g}", (T,))
            lay._add(f"table{g}", (R, w))
        return lay

    def _add(self, name: str, dims: tuple[int, ...]) -> None:
        n = 1
        for x in dims:
            n *= x
        self.segments[name] = (self.total, dims)
        self._sizes[name] = n
        self.total += cdiv(n, _ALIGN) * _ALIGN

    def view(self, buf: Any, name: str) -> Any:
        """The segment `name` of a flat buffer (numpy array or torch tensor), shaped."""
        off, dims = self.segments[name]
        v = buf[off:off + self._sizes[name]]
        return v if len(dims) == 1 else v.reshape(dims)

    def neutral(self, trash_slots: Sequence[int]) -> np.ndarray:
        """Metadata in which every row is padding: no sequence, every write to the trash slot, no carry-over."""
        a = np.zeros(self.total, dtype=np.int32)
        self.fill_defaults(a, trash_slots)
        return a

    def fill_defaults(self, a: np.ndarray, trash_slots: Sequence[int]) -> None:
        """Reset ``a[:total]`` to the padding values (in place)."""
        a[: self.total] = 0
        for name in ("carry", "dec_seq", "tile_seq"):
            self.view(a, name)[...] = -1
        for g, t in enumerate(trash_slots):
            self.view(a, f"slots{g}")[...] = t


class IOPair:
    """One host/device IO pair: a packed int32 metadata buffer on the host (pinned on CUDA) and on the device, the
    sampled-token buffers and the sampler's report buffers (`cbnb.runner.sampling.StepReport`, at most
    `REPORT_COLUMNS` per row), the static logits buffer its graphs write (`logits`, set by the runner when graphs are on:
    one buffer for all of the pair's graphs, so captured outputs do not pile up in the graph pool), and the events
    that order the H2D copy, the compute and the D2H copy.

    Args:
        index: the pair's index (0 or 1).
        num_ints: metadata capacity (int32 elements); max_rows: sampled-token capacity.
        device: the compute device.
    """

    def __init__(self, index: int, num_ints: int, max_rows: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.index = index
        self.device = device
        self.host = torch.zeros(num_ints, dtype=torch.int32, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(num_ints, dtype=torch.int32, device=device)
        self.out_dev = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.out_host = torch.zeros(max_rows, dtype=torch.int64, pin_memory=cuda)
        # The sampler's per-row report (finiteness flag, logprobs), packed [rows, columns] at the front.
        n = max_rows * REPORT_COLUMNS
        self.report_dev = torch.zeros(n, dtype=torch.float64, device=device)
        self.report_host = torch.zeros(n, dtype=torch.float64, pin_memory=cuda)
        self.h2d_done = torch.cuda.Event() if cuda else None
        self.compute_done = torch.cuda.Event() if cuda else None
        self.d2h_done = torch.cuda.Event() if cuda else None
        self.logits: torch.Tensor | None = None
        self._views: dict[tuple, dict[str, torch.Tensor]] = {}

    def views(self, shape: StepShape, layout: MetaLayout) -> dict[str, torch.Tensor]:
        """Device views of every segment for `shape` (cached for padded shapes: graphs bind these addresses)."""
        if shape.padded:
            v = self._views.get(shape.key)
            if v is not None:
                return v
        v = {name: layout.view(self.dev, name) for name in layout.segments}
        if shape.padded:
            self._views[shape.key] = v
        return v


# ------------------------------------------------------------------------------------------------ backends
class GraphBackend:
    """Captures a function into a replayable graph. ``capture(fn)`` returns a handle and runs nothing;
    ``replay(handle)`` runs the captured work and returns its (static) outputs."""

    name = "none"

    def capture(self, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def replay(self, handle: Any) -> Any:
        raise NotImplementedError


class GraphCaptureError(RuntimeError):
    """A graph capture failed. `key` is the graph key; the original error is `error` (and ``__cause__``)."""

    def __init__(self, key: tuple, error: BaseException) -> None:
        super().__init__(f"CUDA graph capture failed for key {key}: {type(error).__name__}: {error}")
        self.key = key
        self.error = error


def capture_into(graph: Any, fn: Callable[[], Any], **begin_kwargs: Any) -> tuple[Any, Any]:
    """``graph.capture_begin(**begin_kwargs)``, ``fn()``, ``graph.capture_end()``; returns ``(graph, fn's output)``.

    When `fn` raises, the capture is still ended (so the stream leaves capture mode) and `fn`'s error is re-raised:
    an error of ``capture_end()`` (an invalidated capture raises there too) is only added to it as a note, never
    raised in its place. When only ``capture_end()`` raises, that error is the cause and propagates.
    """
    graph.capture_begin(**begin_kwargs)
    try:
        out = fn()
    except BaseException as e:
        try:
            graph.capture_end()
        except Exception as end_error:
            e.add_note(f"capture_end() raised as well: {type(end_error).__name__}: {end_error}")
        raise
    graph.capture_end()
    return graph, out


class CudaGraphBackend(GraphBackend):
    """`torch.cuda.CUDAGraph` capture on a side stream, one shared memory pool for all graphs."""

    name = "cuda"

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream") -> None:
        self.device = device
        self.stream = stream
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Any]) -> Any:
        # `torch.cuda.graph(...)` without its per-capture `gc.collect()` / `empty_cache()` (dozens of captures at
        # start-up); "thread_local": other threads may use CUDA while the engine thread captures.
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            return capture_into(g, fn, pool=self.pool, capture_error_mode="thread_local")

    def replay(self, handle: Any) -> Any:
        g, out = handle
        g.replay()
        return out


class FakeGraphBackend(GraphBackend):
    """A CPU stand-in with a graph's semantics: capturing runs nothing; a replay runs the captured closure again,
    with the Python values it captured (so a closure that reads anything but static buffers shows up in tests)."""

    name = "fake"

    def __init__(self) -> None:
        self.log: list[str] = []

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.log.append("capture")
        return fn

    def replay(self, handle: Any) -> Any:
        self.log.append("replay")
        return handle()


class GraphCache:
    """Graphs keyed by padded shape: capture on a miss (after a neutral warm-up), replay on a hit. No eviction.

    Attributes:
        captures, replays: totals (a capture is followed by its first replay, counted as a replay).
        keys_captured: keys in capture order.
        failures: key -> `GraphCaptureError` of each failed capture (that shape then runs eagerly);
            capture_failures: their number; eager_runs: steps of a failed shape run eagerly.
    """

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend
        self.graphs: dict[tuple, Any] = {}
        self.captures = 0
        self.replays = 0
        self.keys_captured: list[tuple] = []
        self.failures: dict[tuple, GraphCaptureError] = {}
        self.capture_failures = 0
        self.eager_runs = 0
        self._new_failures: list[GraphCaptureError] = []

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def take_failures(self) -> list[GraphCaptureError]:
        """The capture failures since the last call (for step telemetry)."""
        out, self._new_failures = self._new_failures, []
        return out

    def _capture(self, key: tuple, fn: Callable[[], Any], warmup: Callable[[], None] | None) -> bool:
        if warmup is not None:
            warmup()  # an error here is the forward's own (eager): it propagates
        try:
            handle = self.backend.capture(fn)
        except Exception as e:
            err = GraphCaptureError(key, e)
            err.__cause__ = e
            self.failures[key] = err
            self.capture_failures += 1
            self._new_failures.append(err)
            return False
        self.graphs[key] = handle
        self.captures += 1
        self.keys_captured.append(key)
        return True

    def capture(self, key: tuple, fn: Callable[[], Any], warmup: Callable[[], None] | None = None) -> bool:
        """Capture `fn` for `key` without running it (a pre-capture at start-up). False when already cached or
        when the capture failed (recorded in `failures`)."""
        if key in self.graphs or key in self.failures:
            return False
        return self._capture(key, fn, warmup)

    def run(self, key: tuple, fn: Callable[[], Any], warmup: Callable[[], None] | None = None) -> tuple[Any, bool]:
        """Replay the graph for `key`, capturing `fn` first on a miss; a shape whose capture failed runs `fn`
        eagerly. Returns (outputs, captured now); ``key in cache`` afterwards tells whether a graph ran."""
        handle = self.graphs.get(key)
        captured = False
        if handle is None:
            if key not in self.failures:
                captured = self._capture(key, fn, warmup)
            if not captured:
                self.eager_runs += 1
                return fn(), False
            handle = self.graphs[key]
        out = self.backend.replay(handle)
        self.replays += 1
        return out, captured


def graph_support(device_type: str, backend: str, attention: str) -> tuple[bool, str]:
    """Whether graphs can be used, and why not. Graphs need the CUDA backend (or the fake one, in tests) and an
    attention path without host synchronisation (the Triton kernels; the torch references read metadata on the
    host, as would any path that builds a mask)."""
    if backend == "fake":
        return True, ""
    if device_type != "cuda":
        return False, f"no CUDA graphs on device type {device_type!r}"
    if backend != "cuda":
        return False, f"graph backend {backend!r} is not 'cuda'"
    if attention != "triton":
        return False, f"attention {attention!r} synchronises with the host (needs 'triton')"
    return True, ""


@contextlib.contextmanager
def maybe_stream(stream: "torch.cuda.Stream | None"):
    """`torch.cuda.stream(stream)` when a stream is given, else nothing."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield
