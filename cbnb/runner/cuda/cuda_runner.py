"""`CudaModelRunner`: the GPU path of the runner: packed static metadata, Triton paged attention, CUDA graphs per
padded shape, and async double-buffered batching.

One step (`launch` then `collect`; `execute` does both):

1. **copies**: swap-outs, then restores, on the compute stream (same order as the CPU runner);
2. **prepare** (host, numpy; the row packers of `cbnb.runner.cuda.packing`): the step's metadata is packed into the
   current IO pair's pinned int32 buffer (`cbnb.runner.cuda.graphs.MetaLayout`): token ids, positions, carry-over
   indices, logits rows, per-request query start/length/past, the decode list and the prefill work list, and per
   layer group the write slots and block tables;
3. **H2D**: one copy of the used prefix of that buffer to its device twin, on the H2D stream (an event orders it
   before the compute);
4. **compute** on the compute stream: the model forward with attention implementation "cbnb_cuda"
   (`cbnb.runner.cuda.attention`, which calls `cbnb.runner.cuda.triton_attention.paged_attention` per layer) and the
   greedy argmax into the pair's static output. With graphs, the forward is captured once per padded shape
   (`GraphCache`) and replayed; rows that sample (``do_sample``) are drawn eagerly after the replay, on the device,
   without host syncs;
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
from types import SimpleNamespace
from typing import Any

import torch

from ...core.plan import KVGeometry, StepKV, StepWork
from ..kv import KVStore
from ..model_runner import ModelRunner
from ..sampling import unpack
from .attention import CUDA_ATTN_NAME, CudaStepBatch, register_cuda_attention
from .capture import StartupCaptures, shape_planner
from .device_checks import pick_attention, sync_debug
from .graphs import (CudaGraphBackend, FakeGraphBackend, GraphCache, IOPair, MetaLayout, StepShape, graph_support,
                     maybe_stream)
from .packing import RowPacker, step_shape
from .records import CudaStepResult, _Launched
from .triton_attention import HAS_TRITON, TRITON_ERROR, kernel_config

__all__ = ["CUDA_ATTN_NAME", "CudaModelRunner", "CudaStepBatch", "CudaStepResult", "register_cuda_attention"]


# ------------------------------------------------------------------------------------------------ the runner
class CudaModelRunner(StartupCaptures, ModelRunner):
    """The runner used when the KV store is on a CUDA device (`cbnb.runner.factory.make_runner` picks it), or
    explicitly in tests.

    Args:
        model, geometry, store, seed: as `ModelRunner`.
        config: a resolved `ContinuousBatchingConfig`; may also be given later with `configure` (the engine loop
            configures an unconfigured runner with `engine.config` before its first step).
        backend: "cuda" (real graphs and streams) or "fake" (CPU stand-in); default: "cuda" on CUDA, else "fake".
        attention: "triton" (kernels) or "torch" (the references); default
            (`cbnb.runner.cuda.device_checks.pick_attention`): "triton" on CUDA when a 1-element Triton kernel
            launches, else "torch" with the reason in ``describe()["attention_reason"]``; the environment variable ``CBNB_ATTENTION`` forces one.
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
        self.planner = shape_planner(config, self.model, self.windows, self.capacity_tokens, self.page_size,
                                     self.store.layout.num_kv_heads, self.num_sms, self.kcfg.prefill_m)
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
        cache manager is never read) with the row packers of `cbnb.runner.cuda.packing`. Returns (shape, layout,
        request -> sample row, KV bytes read)."""
        bm = self.kcfg.prefill_m
        shape = step_shape(entries, self.planner, bm, self.graph_decode, self.graph_varlen)
        lay = self._layout(shape)
        buf = pair.host_np
        lay.fill_defaults(buf, self.trash)
        packer = RowPacker(shape, lay, buf, kv, self.windows, bm, self._prev_rows, self.profile)
        for i, s in enumerate(entries):
            if s.num_tokens == 1:
                packer.decode_row(i, s)
            else:
                packer.chunk_row(i, s)
        self.carried += packer.write(self.trash, self.async_mode)
        kv_bytes = sum(t * n for t, n in zip(packer.kv_tokens, self.layers_per_group)) * self.bytes_per_token_layer
        return shape, lay, packer.rows, kv_bytes

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
