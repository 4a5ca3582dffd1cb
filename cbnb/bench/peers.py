"""The bench's peers, each run once over a workload on an already loaded model.

- ``cbnb``: this engine (a fresh `Engine` per run, after a one-request warm-up);
- ``hf-cb``: transformers' own continuous batching (`init_continuous_batching` + `add_request`, which also allows a
  different `max_new_tokens` per request);
- ``hf-static``: static batched `model.generate` (left padding, batches of ``--static-batch`` requests);
- ``llama-cpp``, ``llama-cpp-q4_1``: llama.cpp's `llama-server` on the F32 GGUF of the same weights and on the
  shipped Q4_1 file, started per run (`cbnb.bench.llamacpp`).

A run returns a `PeerResult`: wall seconds of the timed part, output tokens, peak memory (RSS on CPU, allocated
bytes on CUDA), the greedy tokens per request and extra figures. A failing peer is reported, never fatal.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["PEERS", "LONE_NEW_TOKENS", "PeerResult",
           "run_cbnb", "run_hf_cb", "run_hf_static", "run_variant", "agreement",
           "lone_prompts", "release_memory", "guard"]

PEERS = ("cbnb", "hf-cb", "hf-static", "llama-cpp", "llama-cpp-q4_1")


@dataclass
class PeerResult:
    """One peer's run: wall seconds, tokens, memory peak, per-request tokens and extra figures."""

    name: str
    seconds: float
    output_tokens: int
    peak_bytes: int
    tokens: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


class _PeakMemory:
    """Samples process RSS (CPU) or reads the CUDA allocator peak during a `with` block."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> "_PeakMemory":
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return self
        import psutil

        proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = proc.memory_info().rss

        def sample() -> None:
            while not self._stop.wait(0.05):
                self.peak = max(self.peak, proc.memory_info().rss)

        self._t = threading.Thread(target=sample, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._t.join()


def run_cbnb(model, tokenizer, workload, config, *, name: str = "cbnb", engine_kwargs: dict | None = None,
             on_engine: Callable[[Any], Any] | None = None, lone: list[list[int]] | None = None,
             timeout_s: float | None = None, submit_kwargs: dict | None = None) -> PeerResult:
    """Run the workload through a fresh cbnb `Engine` (after a one-request warm-up); `submit_kwargs` go to every
    request's `submit` (e.g. sampling and logits processors).

    With `lone` prompts, the engine then serves each of them alone (`LONE_NEW_TOKENS` tokens, streamed), idle in
    between: ``extra["lone_ttft_s"]`` holds the seconds from `submit` to the first streamed token of each and
    ``extra["lone_itl_s"]`` the gaps between the next ones (the streaming feel of one user).
    With `timeout_s`, requests unfinished that many seconds after the submission are cancelled and the result is
    partial: the tokens produced until then, over that time, with `error` saying so.
    """
    import torch

    from ..engine.engine import Engine

    eng = Engine(model, tokenizer=tokenizer, config=config, **(engine_kwargs or {}))
    device = eng.device.type
    attach = on_engine(eng) if on_engine is not None else None
    with eng:
        eng.generate([workload.prompts[0][:8]], max_new_tokens=2, ignore_eos=True)  # warm-up
        if hasattr(eng, "reset_stats"):
            eng.reset_stats()
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            handles = [eng.submit(p, max_new_tokens=n, ignore_eos=True, **(submit_kwargs or {}))
                       for p, n in zip(workload.prompts, workload.max_new_tokens)]
            outs, cut_at = _results_until(handles, t0, timeout_s)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = cut_at if cut_at is not None else time.perf_counter() - t0
        extra: dict[str, Any] = {"config": eng.config.to_dict()}
        if hasattr(eng.runner, "compile_stats"):
            extra["compile"] = eng.runner.compile_stats()
        if hasattr(eng, "stats"):
            with contextlib.suppress(Exception):
                extra["stats"] = eng.stats()
        if lone:
            times = [_stream_times(eng, p) for p in lone]
            extra["lone_ttft_s"] = [t[0] for t in times if t]
            extra["lone_itl_s"] = [b - a for t in times for a, b in zip(t, t[1:])]
    if attach is not None and hasattr(attach, "close"):
        attach.close()
    bad = [o for o in outs if o.state.name != "FINISHED"]
    err = f"{len(bad)} requests not FINISHED: {bad[0].error}" if bad else None
    if cut_at is not None:
        err = f"timed out after {timeout_s:.0f} s: {len(outs) - len(bad)} of {len(outs)} requests finished"
    return PeerResult(name, dt, sum(len(o.token_ids) for o in outs), mem.peak, [o.token_ids for o in outs],
                      extra, err)


#: Tokens each lone request streams (the first gives its TTFT, the gaps between the others its ITL).
LONE_NEW_TOKENS = 16


def _stream_times(eng, prompt: list[int], n: int = LONE_NEW_TOKENS) -> list[float]:
    """Seconds from `submit` to each streamed token of one request on an idle engine (the tokens of one delta
    share its time)."""
    t0 = time.perf_counter()
    h = eng.submit(prompt, max_new_tokens=n, ignore_eos=True)
    times: list[float] = []
    for d in h:
        times.extend([time.perf_counter() - t0] * len(d.token_ids))
    h.result()
    return times


def lone_prompts(workload, vocab_size: int, count: int = 3, seed: int = 0) -> list[list[int]]:
    """`count` fresh prompts (no prefix in common with the workload) of the workload's median prompt length."""
    from ..lab.workloads import FIRST_ID

    lengths = sorted(len(p) for p in workload.prompts)
    n = lengths[len(lengths) // 2]
    rng = random.Random(f"lone:{workload.name}:{seed}")
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(n)] for _ in range(count)]


def hf_cb_manager(model, config, max_new_tokens: int):
    """transformers' continuous-batching manager for `model` with `config`'s values, started (greedy, EOS off).

    Also used by `cbnb.bench.engine_peer.HFContinuousBatching` (the notebook A/B with arrival times).
    """
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max_new_tokens)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=config.to_transformers())
    manager.start()
    return manager


def _results_until(handles: list[Any], t0: float, timeout_s: float | None) -> tuple[list[Any], float | None]:
    """Every handle's output; past `timeout_s` after `t0` the unfinished ones are cancelled (their outputs keep the
    tokens produced so far). Returns (outputs, seconds until the timeout, or None when all finished in time)."""
    if timeout_s is None:
        return [h.result() for h in handles], None
    for h in handles:
        try:
            h.result(timeout=max(0.0, t0 + timeout_s - time.perf_counter()))
        except TimeoutError:
            dt = time.perf_counter() - t0
            for other in handles:
                other.cancel()
            return [other.result(timeout=60) for other in handles], dt
    return [h.result() for h in handles], None


def run_hf_cb(model, workload, config, *, timeout_s: float | None = None) -> PeerResult:
    """transformers' continuous batching with the same config values. With `timeout_s`, results are collected for
    that many seconds at most: a partial result counts the requests finished by then, with `error` saying so."""
    import torch

    device = next(model.parameters()).device.type
    manager = hf_cb_manager(model, config, max(workload.max_new_tokens))
    try:
        rid = manager.add_request(workload.prompts[0][:8], max_new_tokens=2)
        _collect(manager, {rid})
        with _PeakMemory(device) as mem:
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, request_id=f"b{i}")
                   for i, (p, n) in enumerate(zip(workload.prompts, workload.max_new_tokens))]
            results = _collect(manager, set(ids), timeout=3600.0 if timeout_s is None else timeout_s)
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    tokens = [list(results[i].generated_tokens) if i in results else [] for i in ids]
    errors = [results[i].error for i in ids if i in results and results[i].error]
    missing = [i for i in ids if i not in results]
    err = None
    if errors or missing:
        err = f"{len(errors)} failed, {len(missing)} missing" + (f": {errors[0]}" if errors else "")
        if missing and timeout_s is not None and dt >= timeout_s:
            err = f"timed out after {timeout_s:.0f} s: {len(results)} of {len(ids)} requests finished"
    return PeerResult("hf-cb", dt, sum(len(t) for t in tokens), mem.peak, tokens, {}, err)


def _collect(manager, ids: set[str], timeout: float = 3600.0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(ids) and time.monotonic() < deadline:
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                break
            continue
        if r.request_id in ids and r.is_finished():
            out[r.request_id] = r
    return out


def run_hf_static(model, workload, batch_size: int) -> PeerResult:
    """Static batched `generate` (left padding), `batch_size` requests per call."""
    import torch

    device = next(model.parameters()).device
    n_total = 0
    tokens: list[list[int]] = []
    with _PeakMemory(device.type) as mem:
        t0 = time.perf_counter()
        for s in range(0, workload.num_requests, batch_size):
            prompts = workload.prompts[s:s + batch_size]
            gens = workload.max_new_tokens[s:s + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(gens),
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            for i, n in enumerate(gens):
                tokens.append(out[i, width:width + n].tolist())
                n_total += n
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return PeerResult("hf-static", dt, n_total, mem.peak, tokens, {"batch_size": batch_size})


def agreement(a: PeerResult, b: PeerResult) -> float:
    """Share of requests whose tokens are identical in both runs."""
    if not a.tokens or len(a.tokens) != len(b.tokens):
        return 0.0
    return sum(x == y for x, y in zip(a.tokens, b.tokens)) / len(a.tokens)


def release_memory() -> None:
    """Drop the previous peer's engine before the next one sizes its cache from free memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guard(name: str, fn: Callable[[], PeerResult]) -> PeerResult:
    try:
        return fn()
    except Exception as e:  # a failing peer is reported, not fatal for the comparison
        return PeerResult(name, 0.0, 0, 0, [], {}, f"{type(e).__name__}: {e}")


def _with_env(name: str, value: str, fn: Callable[[], PeerResult]) -> PeerResult:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


#: The ``sampled=on`` variant's request arguments: sampling with processors, to measure their cost per step.
SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=0)
#: The ``json_schema=on`` variant's schema: every request's output is constrained (structured output's mask cost).
JSON_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}


#: Variants that switch an environment variable of the CPU fast path for their run.
_ENV_VARIANTS = {"cpu_kernels": "CBNB_CPU_KERNELS", "onednn_linear": "CBNB_ONEDNN_LINEAR",
                 "packed_linear": "CBNB_PACKED_LINEAR", "cpu_layers": "CBNB_CPU_LAYERS",
                 "cpu_prefill": "CBNB_CPU_PREFILL", "mkl_gemv": "CBNB_MKL_GEMV"}


def run_variant(model, tokenizer, wl, config, variant: str) -> PeerResult:
    """A cbnb run with one named option: "telemetry=off|on", "dashboard=off|on", "use_cuda_graph=...",
    "use_async_batching=...", "default_compile_level=0..3", "cpu_kernels=off|on" (the decode kernel and the oneDNN
    linears), "onednn_linear=off|on" (the linears alone, `cbnb.runner.cpu.cpu_linear`), "packed_linear=off|on" (their
    packed weights and fused projections alone), "cpu_layers=off|on" (the decoder-layer forward with C ops alone,
    `cbnb.runner.cpu.cpu_layers`), "cpu_prefill=off|on" (the prefill rows' attention kernel alone),
    "mkl_gemv=off|on" (1-row linears through torch's BLAS instead of oneDNN, `cpu_linear.gemv`), "sampled=off|on"
    (every request samples with `SAMPLED`: temperature + top-p + repetition penalty; "sampled=off" is the greedy run),
    "json_schema=off|on" (every request constrained by `JSON_SCHEMA`; ``extra["grammar"]``: the mask's host time,
    `cbnb.runner.grammar.Stats`, and ``mask_ms_per_step``, what the steps waited for masks)."""
    key, _, val = variant.partition("=")
    on = val.lower() in ("1", "on", "true", "yes")
    kwargs: dict[str, Any] = {}
    submit: dict[str, Any] = {}
    hook = None
    if key == "sampled":
        submit = dict(SAMPLED) if on else {}
    elif key == "json_schema":  # grammar masks (cbnb.runner.grammar): their host time lands in extra["grammar"]
        submit = {"json_schema": JSON_SCHEMA} if on else {}
        seen: list = []
        hook = seen.append
    elif key == "telemetry":
        kwargs["telemetry"] = on
    elif key == "dashboard":
        if on:
            def hook(eng):
                from ..ui.headless import attach_headless_dashboard

                return attach_headless_dashboard(eng)
    elif key in ("use_cuda_graph", "use_async_batching"):
        config = config.copy(**{key: on})
    elif key == "default_compile_level":
        config = config.copy(default_compile_level=int(val))
    elif key in _ENV_VARIANTS:  # cbnb.runner.cpu.cpu_kernels / cpu_linear / cpu_layers
        env = _ENV_VARIANTS[key]
        r = _with_env(env, "1" if on else "0",
                      lambda: run_cbnb(model, tokenizer, wl, config, name=f"cbnb[{variant}]"))
        r.extra["variant"] = variant
        return r
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    r = run_cbnb(model, tokenizer, wl, config, name=f"cbnb[{variant}]", engine_kwargs=kwargs, on_engine=hook,
                 submit_kwargs=submit)
    r.extra["variant"] = variant
    if key == "json_schema" and on:
        stats = seen[0].runner.sampler.constraints.stats.as_dict()
        stats["mask_ms_per_step"] = 1e3 * (stats["compute_s"] + stats["wait_s"]) / max(stats["steps"], 1)
        r.extra["grammar"] = stats
    return r
