"""`CudaModelRunner`: the GPU path of the runner: packed static metadata, Triton paged attention, CUDA graphs per
padded shape, and async double-buffered batching.

One step (`launch` then `collect`; `execute` does both):

1. **copies**: swap-outs, then restores, on the compute stream (same order as the CPU runner);
2. **prepare** (host, numpy): the step's metadata is packed into the current IO pair's pinned int32 buffer
   (`cbnb.runner.cuda.graphs.MetaLayout`): token ids, positions, carry-over indices, logits rows, per-request query
   start/length/past, the decode list and the prefill work list, and per layer group the write slots and block tables;
3. **H2D**: one copy of the used prefix of that buffer to its device twin, on the H2D stream (an event orders it
   before the compute);
4. **compute** on the compute stream: the model forward with attention implementation "cbnb_cuda" (this module's
   `cuda_attention_forward`, which calls `cbnb.runner.cuda.triton_attention.paged_attention` per layer) and the greedy
   argmax into the pair's static output. With graphs, the forward is captured once per padded shape (`GraphCache`) and
   replayed; rows that sample (``do_sample``) are drawn eagerly after the replay, on the device, without host syncs;
5. **D2H**: the sampled ids are copied to pinned host memory on the D2H stream; `collect` waits on that event.

**Async batching** (two IO pairs, `async_mode`): the engine schedules and launches step N+1 before it collects and
applies step N, so the CPU prepares N+1 while the GPU computes N. A request whose token from N is not applied yet has
the placeholder -1 at that position (`Request.token_ids`); the runner records the row of that token in N's output,
and the forward (inside the graph) replaces the placeholder with ``prev_out[row]`` read from the *other* pair's
device output. Pairs alternate strictly, so the previous step's output is always the other pair's. Overwrites are
safe: a pair's host buffers are only refilled after its previous step was collected, and its device buffers are only
written by work queued after that step on the same compute stream.

On CPU (tests), the same code runs with ``backend="fake"`` (a graph stand-in that replays captured closures) and
``attention="torch"`` (the kernels' PyTorch references), so batching, padding, graph keys, carry-over and pair
rotation are exercised without a GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ...core.plan import KVGeometry, StepKV, StepResult, StepWork
from ..cpu.attention import paged_attention_forward, register as register_cpu_attention
from .device_checks import pick_attention, sync_debug
from .graphs import (CudaGraphBackend, FakeGraphBackend, GraphCache, IOPair, MetaLayout, ShapePlanner, StepShape,
                     cdiv, graph_support, maybe_stream)
from ..kv import KVStore
from ..model_runner import ModelRunner
from ..sampling import unpack
from .triton_attention import HAS_TRITON, TRITON_ERROR, kernel_config, num_decode_splits, paged_attention

__all__ = ["CUDA_ATTN_NAME", "CudaModelRunner", "CudaStepBatch", "CudaStepResult", "register_cuda_attention"]

CUDA_ATTN_NAME = "cbnb_cuda"
_registered = False


# ------------------------------------------------------------------------------------------------ attention hook
class CudaStepBatch:
    """What each attention layer of a CUDA-runner forward needs (passed as the `cbnb_batch` keyword).

    Attributes:
        meta: step metadata (device int32 tensors ``q_start``, ``q_len``, ``past``, ``dec_seq``, ``tile_seq``,
            ``tile_m0`` and flags ``has_prefill``, ``has_decode``).
        groups: per layer group, ``slots``, ``table``, ``window`` (0: full attention) and ``num_splits``.
        layer_group: layer -> (group, index in group); store: the `KVStore`; impl: "triton" or "torch".
    """

    def __init__(self, meta: Any, groups: list[Any], layer_group: list[tuple[int, int]], store: KVStore,
                 impl: str) -> None:
        self.meta = meta
        self.groups = groups
        self.layer_group = layer_group
        self.store = store
        self.impl = impl

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """One layer: query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
        layer = module.layer_idx
        g = self.layer_group[layer][0]
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = paged_attention(q, k, v, self.store.k[layer], self.store.v[layer], self.meta, self.groups[g], scale,
                              self.impl)
        return out.unsqueeze(0)


def cuda_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """"cbnb_cuda" attention: a `CudaStepBatch` goes to the paged kernels; anything else to "cbnb_paged" (which
    falls back to sdpa without a batch, e.g. a plain ``model.generate`` while an engine holds the model)."""
    batch = kwargs.get("cbnb_batch")
    if isinstance(batch, CudaStepBatch):
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("cbnb_cuda attention does not support attention-logit soft-capping")
        return batch.attend(module, query, key, value, scaling), None
    return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)


def register_cuda_attention() -> None:
    """Register "cbnb_cuda" (attention and sdpa's mask function, as "cbnb_paged" does). Idempotent."""
    global _registered
    if _registered:
        return
    register_cpu_attention()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CUDA_ATTN_NAME, cuda_attention_forward)
    AttentionMaskInterface.register(CUDA_ATTN_NAME, sdpa_mask)
    _registered = True


# ------------------------------------------------------------------------------------------------ results
@dataclass
class CudaStepResult(StepResult):
    """`StepResult` plus graph telemetry: this step's (captures, replays, failed captures), the backend name,
    captured keys, failed captures as (key, error message), and (when profiling) the GPU time of the step."""

    graph_counts: tuple[int, int, int] = (0, 0, 0)
    gpu_ms: float | None = None


@dataclass
class _Launched:
    work: StepWork
    pair: IOPair | None
    entries: list[Any]
    timings: dict[str, float]
    copied: int
    shape: StepShape | None = None
    graph: bool = False
    captured: tuple | None = None
    failed: list[Any] = field(default_factory=list)
    events: tuple | None = None
    kv_bytes: int = 0
    t_launch: float = 0.0
    report_columns: int = 1
    max_logprobs: int = 0


# ------------------------------------------------------------------------------------------------ the runner
class CudaModelRunner(ModelRunner):
    """The runner used when the KV store is on a CUDA device (`cbnb.runner.factory.make_runner` picks it), or
    explicitly in tests.

    Args:
        model, geometry, store, seed: as `ModelRunner`.
        config: a resolved `ContinuousBatchingConfig`; may also be given later with `configure` (the engine loop
            configures an unconfigured runner with `engine.config` before its first step).
        backend: "cuda" (real graphs and streams) or "fake" (CPU stand-in); default: "cuda" on CUDA, else "fake".
        attention: "triton" (kernels) or "torch" (the references); default (`cbnb.runner.cuda.device_checks.pick_attention`):
            "triton" on CUDA when a 1-element Triton kernel launches, else "torch" with the reason in
            ``describe()["attention_reason"]``; the environment variable ``CBNB_ATTENTION`` forces one.
        num_sms: multiprocessors used to pick decode splits (default: the device's, 132 off CUDA).

    ``CBNB_SYNC_DEBUG=warn|error`` runs every step's queueing (H2D, forward or replay, sampling, D2H) under
    ``torch.cuda.set_sync_debug_mode``, so a host synchronisation there warns or raises (graph captures excepted).
    """

    attention_name = CUDA_ATTN_NAME
    supports_prompt_logprobs = False  # its graphs and async steps keep only the sampling rows' logits

    def __init__(self, model: torch.nn.Module, geometry: KVGeometry, store: KVStore, seed: int | None = None,
                 config: Any = None, *, backend: str | None = None, attention: str | None = None,
                 num_sms: int | None = None) -> None:
        super().__init__(model, geometry, store, seed)
        register_cuda_attention()
        cuda = self.device.type == "cuda"
        self.backend_kind = backend or ("cuda" if cuda else "fake")
        if self.backend_kind not in ("cuda", "fake"):
            raise ValueError(f"backend must be 'cuda' or 'fake'; got {backend!r}")
        if self.backend_kind == "cuda" and not cuda:
            raise ValueError("the 'cuda' graph backend needs the KV store on a CUDA device")
        if attention is None:
            attention, self.attention_reason = pick_attention(self.device)  # probes a Triton launch on CUDA
        else:
            self.attention_reason = "" if attention == "triton" else "requested"
        if attention not in ("triton", "torch"):
            raise ValueError(f"attention must be 'triton' or 'torch'; got {attention!r}")
        if attention == "triton" and not HAS_TRITON:
            raise RuntimeError(f"attention='triton' needs Triton: {TRITON_ERROR}")
        self.attention = attention
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 132
        self.num_sms = int(num_sms)
        lay = store.layout
        self.page_size = lay.page_size
        # The fixed geometry, read once (plain data); every step's tables and slots come with its `StepWork.kv`.
        kv_groups = geometry.groups
        self.windows = [g.window for g in kv_groups]
        self.trash = [int(g.write_padding_block) * lay.page_size for g in kv_groups]
        self.capacity_tokens = geometry.capacity_tokens
        self.kcfg = kernel_config(lay.head_dim)
        self.bytes_per_token_layer = lay.bytes_per_token_per_layer
        self.layers_per_group = [len(g.layers) for g in lay.groups]
        self.configured = False
        self.graph_varlen = self.graph_decode = False
        self.graph_reason = "not configured"
        self.async_mode = False
        self.profile = bool(os.environ.get("CBNB_PROFILE_STEPS"))
        self.sync_debug = os.environ.get("CBNB_SYNC_DEBUG") or None  # "warn" / "error": see `launch`
        # Capture the start-up shapes when the engine configures the runner (real CUDA graphs only by default).
        self.precapture = self.backend_kind == "cuda" and os.environ.get("CBNB_PRECAPTURE", "1") != "0"
        self.step_log: list[dict[str, Any]] = []
        self._pending_captures: list[tuple] = []  # start-up captures, reported with the next step's telemetry
        self._pending_failures: list[Any] = []  # start-up capture failures, likewise
        self.carried = 0  # tokens substituted on the device from the previous step's output (async carry-over)
        self._turn = 0
        self._prev_rows: dict[str, int] = {}
        self._prev_pair: IOPair | None = None
        self._layouts: dict[tuple, MetaLayout] = {}
        self._neutral: dict[tuple, torch.Tensor] = {}
        self._mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.compute_stream = self.h2d_stream = self.d2h_stream = None
        if cuda:
            self.compute_stream = torch.cuda.Stream(self.device)
            self.h2d_stream = torch.cuda.Stream(self.device)
            self.d2h_stream = torch.cuda.Stream(self.device)
        if self.backend_kind == "cuda":
            self.graphs = GraphCache(CudaGraphBackend(self.device, self.compute_stream))
        else:
            self.graphs = GraphCache(FakeGraphBackend())
        self.pairs: list[IOPair] = []
        if config is not None:
            self.configure(config)

    # ---------------------------------------------------------------------------------------------- setup
    def configure(self, config: Any, *, use_cuda_graph: Any = None, use_async_batching: bool | None = None) -> None:
        """Size the static buffers and decide graphs/async from a resolved config (keywords override its fields,
        for tests that run the GPU logic on CPU, where `resolve()` turns both off)."""
        if self.backend_kind == "fake" and os.environ.get("CBNB_CUDA_RUNNER") == "fake":
            # CPU smoke runs (`CBNB_CUDA_RUNNER=fake`): `resolve()` turned graphs off for the CPU; run them anyway.
            use_cuda_graph = True if use_cuda_graph is None else use_cuda_graph
            use_async_batching = True if use_async_batching is None else use_async_batching
        graphs = config.cuda_graph_booleans if use_cuda_graph is None else (
            (use_cuda_graph, use_cuda_graph) if isinstance(use_cuda_graph, bool) else tuple(use_cuda_graph))
        want_async = bool(config.use_async_batching if use_async_batching is None else use_async_batching)
        ok, reason = graph_support(self.device.type, self.backend_kind, self.attention)
        self.graph_varlen, self.graph_decode = (bool(graphs[0]), bool(graphs[1])) if ok else (False, False)
        if not ok and any(graphs):
            self.graph_reason = reason
        elif not any(graphs):
            self.graph_reason = "disabled by config"
        else:
            self.graph_reason = ""
        self.async_mode = want_async and (self.graph_varlen or self.graph_decode)
        self.async_reason = "" if self.async_mode else (
            "disabled by config" if not want_async else "async batching requires CUDA graphs")
        q_int = config.q_padding_interval_size or 64
        kv_int = config.kv_padding_interval_size or 16384
        max_pos = self.model.config.get_text_config().max_position_embeddings if hasattr(
            self.model.config, "get_text_config") else getattr(self.model.config, "max_position_embeddings", None)
        caps = []
        if any(w == 0 for w in self.windows):
            caps.append(self.capacity_tokens)
        if max_pos:
            caps.append(int(max_pos))
        kv_cap = min(caps) if caps else 1 << 30
        kv_cap = cdiv(kv_cap, self.page_size) * self.page_size
        self.planner = ShapePlanner(q_interval=q_int, kv_interval=kv_int, max_tokens=int(config.max_batch_tokens),
                                    max_seqs=int(config.max_requests_per_batch), kv_cap=kv_cap,
                                    page_size=self.page_size, windows=self.windows,
                                    num_kv_heads=self.store.layout.num_kv_heads, num_sms=self.num_sms,
                                    block_m=self.kcfg.prefill_m, split_fn=num_decode_splits)
        biggest = MetaLayout.for_shape(self.planner.max_shape())
        self.pairs = [IOPair(i, biggest.total, self.planner.max_seqs, self.device)
                      for i in range(2 if self.async_mode else 1)]
        if self.graph_varlen or self.graph_decode:  # counted by the cache sizing (`cbnb.core.cache.sizing.graph_bytes`)
            head = self.model.get_output_embeddings().weight
            for pair in self.pairs:
                pair.logits = torch.empty(self.planner.max_seqs, head.shape[0], dtype=head.dtype, device=self.device)
        self.graphs = GraphCache(self.graphs.backend)  # graphs bind the old pairs' addresses: start afresh
        self._turn = 0
        self._prev_rows = {}
        self._prev_pair = None
        self.configured = True
        self.precaptured = 0
        if self.precapture and (self.graph_varlen or self.graph_decode):
            self.precaptured = self.capture_presets()

    def preset_shapes(self, max_decode: int | None = None) -> list[StepShape]:
        """The shapes captured at start-up (transformers' warm-up set): decode steps of 1, 2, 4, ... requests up to
        ``max_requests_per_batch`` (or `max_decode`), and a full varlen step, all at the first KV bucket."""
        if not self.configured:
            raise RuntimeError("configure() first")
        pl = self.planner
        kv = min(pl.kv_interval, pl.kv_cap)
        out = []
        if self.graph_decode:
            top = min(pl.max_seqs, max_decode or pl.max_seqs)
            n = 1
            while True:
                out.append(pl.plan(num_tokens=n, num_seqs=n, max_kv=kv, decode_only=True, pad=True))
                if n >= top:
                    break
                n = min(2 * n, top)
        if self.graph_varlen:
            out.append(pl.plan(num_tokens=pl.max_tokens, num_seqs=1, max_kv=kv, decode_only=False, pad=True))
        return out

    @torch.inference_mode()
    def capture_presets(self, max_decode: int | None = None) -> int:
        """Capture the `preset_shapes` for every IO pair before the first step (so captures do not stall serving).
        Uses neutral metadata only: the real cache is never touched. Returns the number of graphs captured."""
        n = 0
        was_active = self._previous_impl is not None
        if not was_active:
            self.activate()  # the captured forward must route attention through "cbnb_cuda"
        try:
            n = self._capture_presets(max_decode)
        finally:
            if not was_active:
                self.deactivate()
        return n

    def _capture_presets(self, max_decode: int | None) -> int:
        n = 0
        with maybe_stream(self.compute_stream):
            for pair in self.pairs:
                for shape in self.preset_shapes(max_decode):
                    lay = self._layout(shape)
                    key = (pair.index,) + shape.key
                    if key in self.graphs:
                        continue
                    lay.fill_defaults(pair.host_np, self.trash)  # what `_warmup` restores: neutral as well
                    if self.graph_capture(key, pair, shape, lay):
                        n += 1
                        self._pending_captures.append(key)
                    self._pending_failures.extend(self.graphs.take_failures())
        if self.compute_stream is not None:
            self.compute_stream.synchronize()
        return n

    def graph_capture(self, key: tuple, pair: IOPair, shape: StepShape, lay: MetaLayout) -> bool:
        return self.graphs.capture(key, lambda: self._forward(pair, shape, lay),
                                   lambda: self._warmup(pair, shape, lay))

    def describe(self) -> dict[str, Any]:
        """The effective GPU-path settings (what the config asked for may have been turned off, with the reason)."""
        return {"backend": self.backend_kind, "attention": self.attention, "attention_reason": self.attention_reason,
                "graphs": (self.graph_varlen, self.graph_decode), "graph_reason": self.graph_reason,
                "async": self.async_mode, "async_reason": getattr(self, "async_reason", ""),
                "io_pairs": len(self.pairs), "graphs_cached": len(self.graphs),
                "captures": self.graphs.captures, "replays": self.graphs.replays, "carried_tokens": self.carried,
                "capture_failures": {str(k): str(e) for k, e in self.graphs.failures.items()},
                "eager_fallback_steps": self.graphs.eager_runs,
                "q_interval": self.planner.q_interval if self.configured else None,
                "kv_interval": self.planner.kv_interval if self.configured else None}

    def _layout(self, shape: StepShape) -> MetaLayout:
        if not shape.padded:
            return MetaLayout.for_shape(shape)
        lay = self._layouts.get(shape.key)
        if lay is None:
            lay = self._layouts[shape.key] = MetaLayout.for_shape(shape)
        return lay

    # ---------------------------------------------------------------------------------------------- prepare
    def _prepare(self, pair: IOPair, entries: list[Any], kv: StepKV) -> tuple[StepShape, MetaLayout, dict[str, int],
                                                                           int]:
        """Pack the step into ``pair.host`` (numpy) from the plan's own KV data (`kv`: block tables and slots; the
        cache manager is never read). Returns (shape, layout, request -> sample row, KV bytes read)."""
        P = self.page_size
        bm = self.kcfg.prefill_m
        n_seqs = len(entries)
        num_tokens = 0
        max_kv = 0
        n_dec = 0
        n_tiles = 0
        for s in entries:
            n = s.num_tokens
            num_tokens += n
            end = s.start + n
            if end > max_kv:
                max_kv = end
            if n == 1:
                n_dec += 1
            else:
                n_tiles += cdiv(n, bm)
        decode_only = n_dec == n_seqs
        pad = self.graph_decode if decode_only else self.graph_varlen
        shape = self.planner.plan(num_tokens=num_tokens, num_seqs=n_seqs, max_kv=max_kv, decode_only=decode_only,
                                  pad=pad, num_tiles=n_tiles, num_dec=n_dec)
        lay = self._layout(shape)
        buf = pair.host_np
        lay.fill_defaults(buf, self.trash)
        ids: list[int] = []
        pos: list[int] = []
        q_start: list[int] = []
        q_len: list[int] = []
        past: list[int] = []
        dec: list[int] = []
        tseq: list[int] = []
        tm0: list[int] = []
        lidx: list[int] = []
        rows: dict[str, int] = {}
        carry_at: list[int] = []
        carry_row: list[int] = []
        kv_rows = kv.rows
        ng = len(kv.groups)
        slots: list[list[int]] = [[] for _ in range(ng)]
        tables = [lay.view(buf, f"table{g}") for g in range(ng)]
        widths = shape.widths
        prev = self._prev_rows
        windows = self.windows
        kv_tokens = [0] * ng
        profile = self.profile
        a = 0
        for i, s in enumerate(entries):
            req = s.request
            rid = req.request_id
            n = s.num_tokens
            st = s.start
            row_tables = kv_rows[rid].tables
            if n == 1:  # decode fast path (same values as `Request.token_ids` / `write_slots`, inlined)
                npr = len(req.prompt_ids)
                if st < npr:
                    tok = req.prompt_ids[st]
                elif st < npr + len(req.output_ids):
                    tok = req.output_ids[st - npr]
                else:
                    tok = -1
                if tok < 0:
                    row = prev.get(rid)
                    if row is None:
                        raise RuntimeError(f"request {rid!r}: unknown token at position {st} and no sample of the "
                                           "previous step to carry over")
                    carry_at.append(a)
                    carry_row.append(row)
                    tok = 0
                ids.append(tok)
                pos.append(st)
                dec.append(i)
                for g in range(ng):
                    t = row_tables[g]
                    win = windows[g]
                    r = st % win if win else st
                    slots[g].append(t[r // P] * P + r % P)
                    w = widths[g]
                    tables[g][i, :len(t)] = t if len(t) <= w else t[:w]
                    if profile:
                        kv_tokens[g] += min(st + 1, win) if win else st + 1
            else:
                toks = req.token_ids(st, st + n)
                if toks[-1] < 0:
                    row = prev.get(rid)
                    if row is None or min(toks[:-1]) < 0:
                        raise RuntimeError(f"request {rid!r}: unknown token at position {st + n - 1} and no sample "
                                           "of the previous step to carry over")
                    carry_at.append(a + n - 1)
                    carry_row.append(row)
                    toks[-1] = 0
                ids.extend(toks)
                pos.extend(range(st, st + n))
                for m0 in range(0, n, bm):
                    tseq.append(i)
                    tm0.append(m0)
                row_slots = kv_rows[rid].write_slots
                for g in range(ng):
                    slots[g].extend(row_slots[g])
                    t = row_tables[g]
                    w = widths[g]
                    tables[g][i, :len(t)] = t if len(t) <= w else t[:w]
                    if profile:
                        win = windows[g]
                        kv_tokens[g] += min(st, win - 1) if win else st
            q_start.append(a)
            q_len.append(n)
            past.append(st)
            if s.samples:
                rows[rid] = len(lidx)
                lidx.append(a + n - 1)
            a += n
        lay.view(buf, "ids")[:a] = ids
        lay.view(buf, "pos")[:a] = pos
        if carry_at:
            if not self.async_mode:
                raise RuntimeError("a token of an unapplied step in synchronous mode (the engine applied steps out of "
                                   "order)")
            lay.view(buf, "carry")[carry_at] = carry_row
            self.carried += len(carry_at)
        lay.view(buf, "logits_idx")[:len(lidx)] = lidx
        lay.view(buf, "q_start")[:n_seqs] = q_start
        lay.view(buf, "q_len")[:n_seqs] = q_len
        lay.view(buf, "past")[:n_seqs] = past
        if dec:
            lay.view(buf, "dec_seq")[:len(dec)] = dec
        if tseq:
            lay.view(buf, "tile_seq")[:len(tseq)] = tseq
            lay.view(buf, "tile_m0")[:len(tm0)] = tm0
        for g in range(ng):
            sv = np.asarray(slots[g], dtype=np.int32)
            sv[sv < 0] = self.trash[g]
            lay.view(buf, f"slots{g}")[:a] = sv
        kv_bytes = sum(kv_tokens[g] * self.layers_per_group[g] for g in range(ng)) * self.bytes_per_token_layer
        return shape, lay, rows, kv_bytes

    # ---------------------------------------------------------------------------------------------- forward
    def _meta(self, pair: IOPair, shape: StepShape, lay: MetaLayout) -> tuple[dict[str, torch.Tensor], CudaStepBatch]:
        v = pair.views(shape, lay)
        meta = SimpleNamespace(q_start=v["q_start"], q_len=v["q_len"], past=v["past"], dec_seq=v["dec_seq"],
                               tile_seq=v["tile_seq"], tile_m0=v["tile_m0"], has_prefill=shape.num_tiles > 0,
                               has_decode=shape.num_dec > 0)
        groups = [SimpleNamespace(slots=v[f"slots{g}"], table=v[f"table{g}"], window=self.windows[g],
                                  num_splits=shape.splits[g]) for g in range(len(self.windows))]
        return v, CudaStepBatch(meta, groups, self.store.layer_group, self.store, self.attention)

    def _forward(self, pair: IOPair, shape: StepShape, lay: MetaLayout) -> torch.Tensor:
        """The captured part of a step: carry-over, model forward, logits rows, greedy argmax into ``pair.out_dev``.
        Reads nothing but static buffers (its arguments are fixed per graph key)."""
        v, batch = self._meta(pair, shape, lay)
        ids = v["ids"].long()
        if self.async_mode:
            other = self.pairs[1 - pair.index].out_dev
            carry = v["carry"].long()
            ids = torch.where(carry >= 0, other[carry.clamp(min=0)], ids)
        kwargs: dict[str, Any] = {}
        lidx = v["logits_idx"].long()
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = lidx
        out = self.model(input_ids=ids.unsqueeze(0), position_ids=v["pos"].long().unsqueeze(0), use_cache=False,
                         attention_mask=self._mask, cbnb_batch=batch, **kwargs)
        logits = out.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, lidx)
        pair.out_dev[:shape.num_seqs].copy_(logits.argmax(-1))
        if shape.padded and pair.logits is not None:  # a graph's output: the pair's static buffer
            pair.logits[:logits.shape[0]].copy_(logits)
            logits = pair.logits[:logits.shape[0]]
        return logits

    def _warmup(self, pair: IOPair, shape: StepShape, lay: MetaLayout) -> None:
        """Run the forward once with neutral metadata (every row padded): compiles kernels and warms the allocator
        without touching the real cache; then restore the step's real metadata."""
        neutral = self._neutral.get(shape.key)
        if neutral is None:
            neutral = self._neutral[shape.key] = torch.from_numpy(lay.neutral(self.trash)).to(self.device)
        pair.dev[:lay.total].copy_(neutral)
        self._forward(pair, shape, lay)
        pair.dev[:lay.total].copy_(pair.host[:lay.total], non_blocking=True)
        if self.compute_stream is not None:
            self.compute_stream.synchronize()

    # ---------------------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def launch(self, work: StepWork) -> _Launched:
        """Queue a step on the device (copies, prepare, H2D, compute, D2H); returns a handle for `collect`."""
        if not self.configured:
            raise RuntimeError("CudaModelRunner.configure(config) must be called before the first step")
        t0 = time.perf_counter()
        with maybe_stream(self.compute_stream):
            copied = self.store.run_copies(work)
        t1 = time.perf_counter()
        timings = {"offload_copy": t1 - t0}
        if work.plan.empty:
            return _Launched(work, None, [], timings, copied, t_launch=t0)
        pair = self.pairs[self._turn]
        if self.async_mode:
            self._turn = 1 - self._turn
        entries = work.plan.scheduled
        shape, lay, rows, kv_bytes = self._prepare(pair, entries, work.kv)
        t2 = time.perf_counter()
        samplers = [s for s in entries if s.samples]
        key = (pair.index,) + shape.key if shape.padded else None
        # CBNB_SYNC_DEBUG: any host synchronisation while queueing the step warns or raises (not while capturing,
        # which synchronises by design).
        capturing = key is not None and key not in self.graphs and key not in self.graphs.failures
        with sync_debug(None if capturing else self.sync_debug):
            graph, captured, events, report = self._queue(pair, shape, lay, key, samplers)
        self._prev_rows = rows
        self._prev_pair = pair
        t3 = time.perf_counter()
        timings.update(prepare=t2 - t1, forward=t3 - t2)
        return _Launched(work, pair, samplers, timings, copied, shape, graph, captured,
                         self.graphs.take_failures(), events, kv_bytes, t0, report.columns, report.max_logprobs)

    def _queue(self, pair: IOPair, shape: StepShape, lay: MetaLayout, key: tuple | None,
               samplers: list[Any]) -> tuple[bool, tuple | None, tuple | None, Any]:
        """H2D, compute (graph replay, capture or eager forward, then sampling) and D2H of a prepared step, queued
        on the streams without waiting. Returns (a graph ran, key captured now, profiling events, the sampler's
        `StepReport`)."""
        n = lay.total
        cuda = self.compute_stream is not None
        if cuda:
            with torch.cuda.stream(self.h2d_stream):
                pair.dev[:n].copy_(pair.host[:n], non_blocking=True)
                pair.h2d_done.record(self.h2d_stream)
            self.compute_stream.wait_event(pair.h2d_done)
        else:
            pair.dev[:n].copy_(pair.host[:n])
        graph = False
        captured = None
        events = None
        with maybe_stream(self.compute_stream):
            if cuda and self.profile:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record(self.compute_stream)
            if key is not None:
                logits, cap = self.graphs.run(key, lambda: self._forward(pair, shape, lay),
                                              lambda: self._warmup(pair, shape, lay))
                if cap:
                    captured = key
                graph = key in self.graphs  # False: its capture failed, the step ran eagerly
            else:
                logits = self._forward(pair, shape, lay)
            # Greedy ids are in `out_dev` already (the captured argmax); processed rows are drawn in one batched pass.
            ns = len(samplers)
            _, report = self.sampler.sample(logits, samplers, out=pair.out_dev[:ns])
            nr = ns * report.columns
            pair.report_dev[:nr].view(ns, report.columns).copy_(report.data)
            if cuda:
                if events is not None:
                    events[1].record(self.compute_stream)
                pair.compute_done.record(self.compute_stream)
        if cuda:
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(pair.compute_done)
                pair.out_host[:ns].copy_(pair.out_dev[:ns], non_blocking=True)
                pair.report_host[:nr].copy_(pair.report_dev[:nr], non_blocking=True)
                pair.d2h_done.record(self.d2h_stream)
        else:
            pair.out_host[:ns].copy_(pair.out_dev[:ns])
            pair.report_host[:nr].copy_(pair.report_dev[:nr])
        return graph, captured, events, report

    def collect(self, launched: _Launched) -> CudaStepResult:
        """Wait for a launched step's sampled ids and return them."""
        t0 = time.perf_counter()
        timings = dict(launched.timings)
        pair = launched.pair
        if pair is None:
            return CudaStepResult({}, timings, launched.copied, backend=self.backend_name())
        if pair.d2h_done is not None:
            pair.d2h_done.synchronize()
        ns = len(launched.entries)
        toks = pair.out_host[:ns].tolist()
        c = launched.report_columns
        report = pair.report_host[:ns * c].view(ns, c).tolist()
        tokens, logprobs, invalid = unpack(launched.entries, toks, report, launched.max_logprobs)
        gpu_ms = None
        if launched.events is not None:
            gpu_ms = launched.events[0].elapsed_time(launched.events[1])
        timings["sample"] = time.perf_counter() - t0
        shape = launched.shape
        if self.profile and shape is not None:
            sched = launched.work.plan.scheduled
            self.step_log.append({"kind": shape.kind, "key": list(shape.key), "graph": launched.graph,
                                  "requests": len(sched), "tokens": sum(s.num_tokens for s in sched),
                                  "padded_tokens": shape.num_tokens, "kv_bytes": launched.kv_bytes,
                                  "gpu_ms": gpu_ms, "host_prepare_s": timings.get("prepare", 0.0),
                                  "captured": launched.captured is not None})
        captured = self._pending_captures + ([launched.captured] if launched.captured is not None else [])
        self._pending_captures = []
        failed = [(f.key, str(f)) for f in self._pending_failures + launched.failed]
        self._pending_failures = []
        counts = (len(captured), 1 if launched.graph else 0, len(failed))
        return CudaStepResult(tokens, timings, launched.copied, graph_counts=counts,
                              backend=self.backend_name(launched.graph), graph_captured=captured,
                              graph_failed=failed, gpu_ms=gpu_ms, logprobs=logprobs, invalid=invalid)

    def execute(self, work: StepWork) -> CudaStepResult:
        """A synchronous step (`launch` then `collect`)."""
        return self.collect(self.launch(work))

    def backend_name(self, graph: bool = False) -> str:
        base = "cuda" if self.backend_kind == "cuda" else f"{self.device.type}-fake"
        return f"{base}-{'graph' if graph else 'eager'}{'-async' if self.async_mode else ''}"
