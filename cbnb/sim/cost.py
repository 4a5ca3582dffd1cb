"""The per-step cost model: seconds for one step of cbnb's runner, from the step's plan (torch-free).

Input: a `StepLoad` read from the core's `StepWork` (`StepLoad.from_work`): per scheduled request its past length
``s`` (`ScheduledRequest.start`), query tokens ``n`` and whether it samples, plus the bytes the step swaps between
host and device. Nothing about scheduling is decided here.

Formula (a roofline per operator group, after Williams, Waterman & Patterson, "Roofline", CACM 2009, applied per
operator like Vidur, Agrawal et al., MLSys 2024)::

    t_group  = max(FLOPs / effective peak, bytes / effective bandwidth)
    compute  = L * (t_linear(T) + t_elementwise(T)) + sum over layer groups of layers_g * t_attention_g
               + t_lm_head(S) + t_sample(S) + t_swap
    launch   = L * layer_launch + attention calls * attention_call + 8 kernels   (eager; 0 with a CUDA graph)
    host     = step_overhead (eager) | step_overhead_graph (graph) + B * request_overhead
    step     = host + launch + compute                      (runner "cpu": one CPU does everything in turn)
             = host + max(launch, compute)                  (runner "cuda", eager: launches overlap kernels)
             = host + compute                               (runner "cuda", CUDA graph replay)

On a profile with `cost_factors` (CPU, fitted end to end by `calibrate()`), each group is scaled by its factor:
compute (linear, elementwise, lm_head, sample; a curve over the step's query tokens), prefill attention, decode
attention and fixed (host + launch);
`StepCost.groups` keeps the unscaled seconds. The CPU decode kernel costs ``decode_kernel_call_s +
kernel_thread_bytes / decode_kernel_bandwidth`` per layer (its busiest thread, see `kernel_thread_bytes`); a row's
keys in blocks an earlier row of the step read (a shared prefix, cache-hot) count at ``decode_kernel_bandwidth /
decode_kernel_shared_bandwidth``.

with T query tokens in the step (padded as the CUDA runner pads graph shapes), B scheduled requests, S sampled rows,
L decoder layers, ``a`` bytes per element, h hidden, I intermediate, H/Hkv heads, d head_dim, V vocab. With async
batching (`SimEngine`), the host part of step N+1 overlaps the device part of step N, as in cbnb's engine loop.

Operator groups, per decoder layer:

- **linear** (q, k, v, o, gate, up, down): FLOPs ``2 T (h H d + 2 h Hkv d + H d h + 3 h I)``; bytes: the weights
  once per step plus ``a T (7h + (2H + 2Hkv) d + 3I)`` activations in and out. Rate: the profile's GEMM rate at T rows.
- **attention**, per request of the step, each layer of group g (window w, None for full attention): keys of query
  ``i`` = ``min(s + i + 1, w)``; FLOPs ``4 H d sum_i keys_i`` (QK^T and PV); the CPU runner computes the full
  ``n x keys`` rectangle when it passes a mask (a chunk with a past, or a fresh chunk longer than the window); bytes:
  the request's real KV, ``min(s + n, w) * 2 Hkv d a`` (paged: no whole-cache mask), plus Q/O ``2 n H d a`` and the
  KV write ``n 2 Hkv d a``; the CPU runner also copies gathered pages (read + write), and its batched decode call
  (the decode rows whose keys span several pages, padded to the widest) runs at the measured `gather_bandwidth`
  when the profile has one, and a chunk with a past, when the profile measured that path (`calibrate`), costs
  ``past_attention_call_s + keys * past_attention_key_s + FLOPs / past_attention_flops`` (its page gather and
  mask grow with the keys, not only with the FLOPs); with the compiled prefill kernel (`prefill_kernel_flops`,
  float32, full-attention layers) a layer's chunks cost ``prefill_kernel_call_s + FLOPs / prefill_kernel_flops``,
  causal FLOPs only and one call. Calls: CPU runner, one per prefill chunk (one per layer with the kernel), one per
  decode row whose keys fit one page, one batched call for the other decode rows; CUDA runner, a KV-store kernel, a
  prefill kernel and a decode + reduce kernel pair per layer.
- **elementwise** (RMSNorms, RoPE, residual adds, activation): bytes ``a T ((7 norms + 6) h + (11 + 7 qk_norm)(H +
  Hkv) d + 5 I)``, the reads and writes of transformers' eager decoder layer; rate: the elementwise bandwidth (on a
  CPU, `calibrate()` times these very ops, so transcendental ones such as SiLU and rsqrt count at their real cost).

Once per step: **lm_head** ``2 S h V`` FLOPs over ``a h V`` weight bytes (only sampled rows, `logits_to_keep`);
**sample** ``12 S V`` bytes (greedy: the fp32 logits rows gathered, read + written, then read by argmax); **swap**
``bytes / host_device_bandwidth``.
"""

from __future__ import annotations

import math
from typing import Any

from .loads import RowLoad, StepCost, StepLoad
from .profiles import HardwareProfile
from .shapes import ModelShape

__all__ = ["RowLoad", "StepLoad", "StepCost", "CostModel", "sum_keys", "elementwise_elems", "gathered_decode_bytes",
           "decode_kernel_bytes", "kernel_thread_bytes", "log_interp_weights", "pad_to_interval", "next_pow2"]

_EXTRA_KERNELS = 8  # embedding, final norm, LM head, logits gather, sampling, copies (eager, per step)


def elementwise_elems(shape: ModelShape) -> int:
    """Elements read + written per token per decoder layer by the elementwise ops (see the module docstring)."""
    h, d, H, Hkv, i = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads, shape.intermediate_size
    return (7 * shape.norms_per_layer + 6) * h + (11 + (7 if shape.qk_norm else 0)) * (H + Hkv) * d + 5 * i


def gathered_decode_bytes(shape: ModelShape, kv_lens: list[int], page: int) -> int:
    """Bytes of the CPU runner's batched decode call for rows with these KV lengths (one layer): each row's K/V, query,
    output and new K/V, plus the gathered copy of every row's pages, padded to the widest row (read + write)."""
    kvb = 2 * shape.num_kv_heads * shape.head_dim * shape.itemsize
    qo = 2 * shape.num_heads * shape.head_dim * shape.itemsize
    width = max(-(-kv // page) for kv in kv_lens)
    return sum(kv * kvb + qo + kvb for kv in kv_lens) + 2 * len(kv_lens) * width * page * kvb


def decode_kernel_bytes(shape: ModelShape, kv_lens: list[float]) -> float:
    """Bytes the cost model counts for the CPU decode kernel over rows with these KV lengths (one layer): each row's
    K/V read in place, its query and output, and its new K/V."""
    kvb = 2 * shape.num_kv_heads * shape.head_dim * shape.itemsize
    qo = 2 * shape.num_heads * shape.head_dim * shape.itemsize
    return sum(kv * kvb + qo + kvb for kv in kv_lens)


def kernel_thread_bytes(shape: ModelShape, kv_lens: list[float], threads: int | None) -> float:
    """`decode_kernel_bytes` (`kv_lens` may be fractional: cache-hot keys weighted) as the CPU decode kernel's threads
    see it: its work items are (row, KV head) pairs,
    handed out dynamically, so the call lasts as long as the busiest thread; returns ``threads`` x that thread's
    bytes (largest items first onto the least-loaded thread, Graham's LPT rule). Equals `decode_kernel_bytes` when
    the items spread evenly (or `threads` is None / 1)."""
    total = decode_kernel_bytes(shape, kv_lens)
    T = int(threads or 1)
    hkv = shape.num_kv_heads
    if T <= 1 or not kv_lens or len(kv_lens) * hkv >= 8 * T:  # many items: the dynamic schedule evens them out
        return float(total)
    loads = [0.0] * T
    items = sorted((decode_kernel_bytes(shape, [kv]) / hkv for kv in kv_lens for _ in range(hkv)), reverse=True)
    for b in items:
        j = loads.index(min(loads))
        loads[j] += b
    return T * max(loads)


def log_interp_weights(rows: list[float], n: float) -> list[float]:
    """Weights of linear interpolation in log(rows) at `n` over the sorted points `rows` (held beyond the ends):
    ``value(n) = sum_i w_i value_i``, the weights sum to 1."""
    w = [0.0] * len(rows)
    x = math.log(max(1.0, float(n)))
    xs = [math.log(max(1.0, float(r))) for r in rows]
    if x <= xs[0]:
        w[0] = 1.0
    elif x >= xs[-1]:
        w[-1] = 1.0
    else:
        i = next(i for i in range(1, len(xs)) if x <= xs[i])
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        w[i - 1], w[i] = 1.0 - f, f
    return w


def sum_keys(start: int, n: int, window: int | None) -> int:
    """Sum over the chunk's queries (positions start .. start+n-1) of the keys each attends: min(p + 1, window)."""
    lo, hi = start + 1, start + n  # keys of the first and last query without a window
    if window is None or hi <= window:
        return (lo + hi) * n // 2
    if lo >= window:
        return window * n
    below = window - lo  # queries whose key count is still below the window: lo .. window-1
    return (lo + window - 1) * below // 2 + window * (n - below)


def pad_to_interval(n: int, interval: int, cap: int | None = None) -> int:
    """`cbnb.runner.cuda.graphs.pad_to_interval` (same arithmetic, torch-free): n up to a multiple, 0 -> one interval."""
    p = max(1, -(-n // interval)) * interval
    return max(n, min(p, cap)) if cap is not None else p


def next_pow2(n: int, cap: int | None = None) -> int:
    """`cbnb.runner.cuda.graphs.next_pow2` (torch-free): the smallest power of two >= max(n, 1), capped, never below n."""
    p = 1 << max(0, (max(n, 1) - 1).bit_length())
    return max(n, min(p, cap)) if cap is not None else p


class CostModel:
    """Seconds per step for one model shape on one hardware profile.

    Args:
        shape: the model (its dtype is the weights' and the KV cache's).
        profile: the device.
        config: a resolved `ContinuousBatchingConfig` (page_size, CUDA graphs, padding intervals, max_batch_tokens,
            max_requests_per_batch); None: page 256, no graphs.
    """

    def __init__(self, shape: ModelShape, profile: HardwareProfile, config: Any = None) -> None:
        self.shape = shape
        self.profile = profile
        s = shape
        self.a = s.itemsize
        self.dtype = s.dtype
        self.page = int(getattr(config, "page_size", 256) or 256)
        graphs = getattr(config, "cuda_graph_booleans", (False, False)) if config is not None else (False, False)
        self.graph_varlen, self.graph_decode = (bool(graphs[0]), bool(graphs[1])) if profile.kind == "gpu" else (
            False, False)
        self.q_interval = int(getattr(config, "q_padding_interval_size", 0) or 64)
        self.max_tokens = getattr(config, "max_batch_tokens", None)
        self.max_requests = getattr(config, "max_requests_per_batch", None)
        h, d, H, Hkv, i = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, s.intermediate_size
        self.layer_matmul_params = h * H * d + 2 * h * Hkv * d + H * d * h + 3 * h * i
        self.linear_act_elems = 7 * h + (2 * H + 2 * Hkv) * d + 3 * i
        self.elementwise_elems = elementwise_elems(s)
        self.kv_token_bytes = 2 * Hkv * d * self.a  # K and V of one token in one layer
        f = dict(profile.cost_factors or {})
        fc = f.get("compute", 1.0)
        self.f_compute_curve = [(float(r), float(v)) for r, v in fc] if isinstance(fc, (list, tuple)) else [(1.0, fc)]
        self.f_attention = f.get("attention", 1.0)
        self.f_decode, self.f_fixed = f.get("decode_attention", 1.0), f.get("fixed", 1.0)
        types = s.layer_types or (("sliding_attention" if s.sliding_window else "full_attention"),) * s.num_layers
        self.groups: list[tuple[int, int | None]] = []  # (layers, window)
        for t in dict.fromkeys(types):
            self.groups.append((sum(1 for x in types if x == t), s.sliding_window if t == "sliding_attention" else None))

    # ------------------------------------------------------------------------------------------ pieces
    def _roofline(self, flops: float, nbytes: float, rate: float) -> float:
        return max(flops / rate, nbytes / self.profile.bandwidth)

    def _padded(self, load: StepLoad, graph: bool) -> int:
        t = load.num_tokens
        if not graph:
            return t
        if load.is_decode:
            return next_pow2(len(load.rows), self.max_requests)
        return pad_to_interval(t, self.q_interval, self.max_tokens)

    def _kernel_keys(self, r: RowLoad, window: int | None) -> float:
        """A decode row's keys for the CPU kernel's bandwidth: shared keys (cache-hot, full attention only) count at
        the ratio of the two measured rates."""
        p = self.profile
        if window is not None:
            return float(min(r.start + 1, window))
        hot = min(r.shared, r.start) if p.decode_kernel_shared_bandwidth else 0
        ratio = p.decode_kernel_bandwidth / p.decode_kernel_shared_bandwidth if hot else 0.0
        return r.start + 1 - hot + hot * ratio

    def _attention(self, rows: tuple[RowLoad, ...], window: int | None) -> tuple[float, float, float, float, int]:
        """(seconds of the prefill chunks, seconds of the decode rows, FLOPs, bytes, calls) of one layer of a group
        with this window (before the profile's cost factors)."""
        s, p = self.shape, self.profile
        qo = 2 * s.num_heads * s.head_dim * self.a
        per_key = 4 * s.num_heads * s.head_dim
        cpu = p.runner == "cpu"
        kernel = cpu and p.decode_kernel_bandwidth is not None and self.dtype == "float32"
        # the compiled prefill kernel: every chunk of a full-attention layer in one causal call
        pre_kernel = cpu and window is None and p.prefill_kernel_flops is not None and self.dtype == "float32"
        pre_flops = 0.0
        k_bytes = 0.0
        page = self.page
        t = flops = nbytes = 0.0
        calls = 0
        gathered: list[int] = []  # CPU: KV lengths of decode rows whose keys span several pages (one batched call)
        g_flops = 0.0
        dec_flops = dec_bytes = 0.0
        has_prefill = False
        for r in rows:
            kv = r.start + r.tokens if window is None else min(r.start + r.tokens, window)
            row_bytes = kv * self.kv_token_bytes + r.tokens * (qo + self.kv_token_bytes)
            if r.tokens == 1 and r.start > 0:  # a decode row (one query over its past)
                if kernel:  # every decode row in one compiled call, pages read in place
                    k_bytes += row_bytes
                    flops += per_key * kv
                    continue
                if cpu and -(-kv // page) > 1:
                    gathered.append(kv)
                    g_flops += per_key * kv
                    continue
                calls += 1 if cpu else 0
                dec_flops += per_key * kv
                dec_bytes += row_bytes
                continue
            has_prefill = True
            if pre_kernel:
                f = per_key * sum_keys(r.start, r.tokens, None)
                pre_flops += f
                flops += f
                nbytes += row_bytes
                continue
            masked = r.start > 0 or (window is not None and r.tokens > window)
            if cpu and masked:
                f = per_key * r.tokens * kv  # the masked rectangle
                row_bytes += 2 * (-(-kv // page) * page) * self.kv_token_bytes if r.start > 0 else 0  # page gather
            else:
                f = per_key * sum_keys(r.start, r.tokens, window)
            if cpu:
                calls += 1
            flops += f
            nbytes += row_bytes
            if cpu and r.start > 0 and p.past_attention_flops:  # measured as call + per key + FLOPs
                t += p.past_attention_call_s + kv * p.past_attention_key_s + f / p.past_attention_flops
                continue
            t += self._roofline(f, row_bytes, p.attention_rate(self.dtype, r.tokens))
        if pre_flops:
            calls += 1
            t += p.prefill_kernel_call_s + pre_flops / p.prefill_kernel_flops
        t_dec = 0.0  # decode rows (the compiled kernel, or the per-row / batched torch paths)
        if dec_flops or dec_bytes:
            t_dec += self._roofline(dec_flops, dec_bytes, p.attention_rate(self.dtype, 1))
            flops += dec_flops
            nbytes += dec_bytes
        if k_bytes:
            calls += 1
            t_dec += p.decode_kernel_call_s + kernel_thread_bytes(
                s, [self._kernel_keys(r, window) for r in rows if r.tokens == 1 and r.start > 0],
                p.threads) / p.decode_kernel_bandwidth
            nbytes += k_bytes
        if gathered:
            calls += 1
            b = gathered_decode_bytes(s, gathered, page)
            t_dec += b / p.gather_bandwidth if p.gather_bandwidth else self._roofline(g_flops, b, p.attention_rate(
                self.dtype, 1))
            flops += g_flops
            nbytes += b
        if not cpu:
            calls = 1 + (1 if has_prefill else 0) + (2 if dec_flops or gathered else 0)
        return t, t_dec, flops, nbytes, calls

    # ------------------------------------------------------------------------------------------ a step
    def step(self, load: StepLoad) -> StepCost:
        """Predicted cost of one step (see the module formula). An empty step costs the host overhead only."""
        s, p = self.shape, self.profile
        B, S = len(load.rows), load.num_samples
        graph = p.runner == "cuda" and bool(load.rows) and (self.graph_decode if load.is_decode else self.graph_varlen)
        host = (p.step_overhead_graph_s if graph else p.step_overhead_s) + B * p.request_overhead_s
        parts: dict[str, float] = {}
        groups = dict.fromkeys(("compute", "attention", "decode_attention", "fixed", "swap"), 0.0)
        flops = nbytes = 0.0
        calls = 0
        if load.rows:
            T = self._padded(load, graph)
            L, a = s.num_layers, self.a
            f = 2.0 * T * self.layer_matmul_params
            b = a * (self.layer_matmul_params + T * self.linear_act_elems)
            parts["linear"] = L * self._roofline(f, b, p.gemm_rate(self.dtype, T))
            flops += L * f
            nbytes += L * b
            b = a * T * self.elementwise_elems
            parts["elementwise"] = (L * b + a * T * 8 * s.hidden_size) / p.elementwise_rate(self.dtype, T)
            nbytes += L * b
            for layers, window in self.groups:
                t, td, af, ab, c = self._attention(load.rows, window)
                groups["attention"] += layers * t
                groups["decode_attention"] += layers * td
                flops += layers * af
                nbytes += layers * ab
                calls += layers * c
            parts["attention"] = self.f_attention * groups["attention"] + self.f_decode * groups["decode_attention"]
            f = 2.0 * S * s.hidden_size * s.vocab_size
            b = a * s.hidden_size * (s.vocab_size + S) + 4 * S * s.vocab_size
            parts["lm_head"] = self._roofline(f, b, p.gemm_rate(self.dtype, max(S, 1))) if S else 0.0
            parts["sample"] = 12.0 * S * s.vocab_size / p.bandwidth
            flops += f if S else 0.0
            nbytes += (b if S else 0) + 12.0 * S * s.vocab_size
        parts["swap"] = load.swap_bytes / p.host_device_bandwidth
        nbytes += load.swap_bytes
        f_compute = self.compute_factor(load.num_tokens)
        for k in ("linear", "elementwise", "lm_head", "sample"):
            if k in parts:
                groups["compute"] += parts[k]
                parts[k] *= f_compute
        groups["swap"] = parts["swap"]
        compute = sum(parts.values())
        if graph or not load.rows:
            launch = 0.0
        else:
            launch = (s.num_layers * p.layer_launch_s + calls * p.attention_call_cost_s
                      + _EXTRA_KERNELS * p.kernel_launch_s)
        groups["fixed"] = host + launch
        launch *= self.f_fixed
        host *= self.f_fixed
        if p.runner == "cpu" or graph:
            total = host + launch + compute
        else:
            total = host + max(launch, compute)
        return StepCost(host, launch, compute, total, parts, flops, nbytes, graph, groups)

    def compute_factor(self, tokens: int) -> float:
        """The profile's compute factor at a step of `tokens` query tokens (its curve interpolated in log rows)."""
        rows = [r for r, _ in self.f_compute_curve]
        return sum(w * v for w, (_, v) in zip(log_interp_weights(rows, tokens), self.f_compute_curve))

    def __call__(self, load: StepLoad) -> float:
        return self.step(load).total_s

    def describe(self) -> dict[str, Any]:
        """The constants the model uses (for docs and tests)."""
        return {"layer_matmul_params": self.layer_matmul_params, "linear_act_elems": self.linear_act_elems,
                "elementwise_elems": self.elementwise_elems, "kv_token_bytes": self.kv_token_bytes,
                "groups": list(self.groups), "page_size": self.page, "graphs": (self.graph_varlen, self.graph_decode),
                "itemsize": self.a, "dtype": self.dtype}

