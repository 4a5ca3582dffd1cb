"""`ModelRunner`: runs one step of a transformers model over the paged cache and samples.

A step: copy offloaded blocks (device -> host), restore swapped-in blocks (host -> device), pack the batch
(`build_step_batch`), one model forward with ``logits_to_keep`` = the rows that sample (so the LM head only sees
those rows), then sampling. The model's attention implementation is switched to "cbnb_paged" while the runner is
active and restored by `deactivate()`; on CPU its linears then run through oneDNN in the runner's eager forwards
(`cbnb.runner.cpu.cpu_linear`). With a compile config (`default_compile_level`, `varlen_compile_config`,
`decode_compile_config`), the forward runs under `torch.compile` (`cbnb.runner.cpu.compiled`): pure-decode steps with
the decode config, the others with the varlen config.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

import torch

from ..core.plan import KVGeometry, StepResult, StepWork
from .cpu import cpu_layers, cpu_linear
from .cpu.attention import ATTN_NAME, register
from .batch import build_step_batch
from .cpu.compiled import compiled_forward, resolve_compile_configs
from .kv import KVStore
from .sampling import Sampler, unpack

__all__ = ["ModelRunner", "StepResult"]

# model -> [active runners, attention implementation to restore]; shared by every runner of the process.
_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
_ACTIVE_LOCK = threading.Lock()
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


class ModelRunner:
    """Executes `StepWork` on a model (the CPU path; `cbnb.runner.factory.make_runner` picks the runner).

    Args:
        model: a transformers causal LM (eval mode).
        geometry: the cache's fixed `KVGeometry` (`CacheManager.geometry()`): not read by this runner (every step's
            block tables and slots come with its `StepWork.kv`); every runner has `make_runner`'s signature.
        store: the `KVStore` (tensors).
        seed: engine-wide sampling seed (`ContinuousBatchingConfig.seed`).

    The engine loop relies on: `activate`/`deactivate`, `configured`/`configure(config)`, `async_mode` (False:
    `execute(work)` runs a whole step; True: `launch(work)` then `collect(handle)`), `forget`, `inherit`.
    """

    #: The attention implementation this runner routes the model through.
    attention_name = ATTN_NAME
    #: Synchronous steps only (the CUDA runner sets this once configured for async batching).
    async_mode = False
    #: Whether `execute` returns prompt logprobs for requests that ask (`Engine.submit(prompt_logprobs=k)`).
    supports_prompt_logprobs = True

    def __init__(self, model: torch.nn.Module, geometry: KVGeometry, store: KVStore, seed: int | None = None) -> None:
        register()
        self.model = model
        self.store = store
        self.device = store.device
        self.sampler = Sampler(self.device, seed)
        self._previous_impl: str | None = None
        self.supports_logits_to_keep = bool(getattr(model, "_supports_logits_to_keep", lambda: True)())
        self.configured = False  # the engine calls configure() before the first step
        self._compiled: tuple = (None, None)  # (varlen, decode) CompiledForward or None (eager)
        self._onednn: bool | None = None  # eager CPU forwards through oneDNN linears (decided at the first one)

    def configure(self, config) -> None:
        """Resolve the compile configs of `config` (a `ContinuousBatchingConfig`); None of them: eager."""
        varlen, decode = resolve_compile_configs(config, self.model)
        self._compiled = tuple(compiled_forward(self.model, c, _NO_MASK) if c else None for c in (varlen, decode))
        self.configured = True

    def compile_stats(self) -> dict:
        """Per path ("varlen", "decode"): the compiled forward's stats (compiles, compile_s, calls, failed) or None
        (eager, or the same compiled forward as the varlen path)."""
        varlen, decode = self._compiled
        out = {"varlen": dict(varlen.stats) if varlen is not None else None,
               "decode": dict(decode.stats) if decode is not None else None}
        if decode is not None and decode is varlen:
            out["decode"] = None  # one compiled forward serves both paths: its figures are under "varlen"
        return out

    def activate(self) -> None:
        """Route the model's attention through cbnb (remembering the previous implementation).

        Activations are counted per model: several engines may share one model, and the original implementation
        comes back only when the last of them deactivates (otherwise stopping one engine would switch the others'
        forwards to plain sdpa, which ignores the paged cache).
        """
        if self._previous_impl is not None:
            return
        with _ACTIVE_LOCK:
            entry = _ACTIVE.get(self.model)
            if entry is None:
                entry = _ACTIVE[self.model] = [0, self.model.config._attn_implementation]
                self.model.set_attn_implementation(self.attention_name)
            entry[0] += 1
            self._previous_impl = entry[1]
            if self.device.type == "cpu" and self._onednn is None:
                # Pack the linears' weights now (about a second for SmolLM2), not in the first request's forward.
                self._onednn = _route_cpu(self.model)

    def deactivate(self) -> None:
        """Restore the model's original attention implementation (once no other runner uses the model)."""
        if self._previous_impl is None:
            return
        with _ACTIVE_LOCK:
            entry = _ACTIVE.get(self.model)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    del _ACTIVE[self.model]
                    self.model.set_attn_implementation(entry[1])
                    cpu_linear.unroute(self.model)
                    cpu_layers.unroute(self.model)
            self._previous_impl = None
            self._onednn = None

    @property
    def active(self) -> bool:
        """Whether the model's attention is routed through this runner (between `activate` and `deactivate`)."""
        return self._previous_impl is not None

    def release(self) -> None:
        """Drop the KV store: the engine frees its pool (before sizing a new one, or for good)."""
        self.store = None

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    def inherit(self, previous: "ModelRunner") -> None:
        """Take over what must survive an engine rebuild from the runner it replaces (per-request RNG streams)."""
        self.sampler.adopt(previous.sampler)

    @torch.inference_mode()
    def execute(self, work: StepWork) -> StepResult:
        """Run the copies and the forward of one step; return the sampled tokens."""
        t0 = time.perf_counter()
        copied = self.store.run_copies(work)
        t1 = time.perf_counter()
        timings = {"offload_copy": t1 - t0}
        if work.plan.empty:
            return StepResult({}, timings, copied)
        batch = build_step_batch(work.plan.scheduled, work.kv, self.store, self.device)
        t2 = time.perf_counter()
        extra, targets = _prompt_logprob_rows(work.plan.scheduled, batch)
        rows = batch.logits_indices
        if extra:
            rows = torch.cat([rows, torch.tensor(extra, dtype=torch.long, device=rows.device)])
        keep = rows if self.supports_logits_to_keep else None
        fwd = self._compiled[1 if all(s.num_tokens == 1 for s in work.plan.scheduled) else 0]
        if extra:
            fwd = None  # eager: the compiled forward is specialised on the sampling rows
        if fwd is not None:
            logits = fwd(batch.input_ids, batch.position_ids, keep, batch)
        else:
            kwargs = {} if keep is None else {"logits_to_keep": keep}
            # A prepared (4-D) mask makes transformers skip mask creation; cbnb_paged attention ignores it.
            with self._linears():
                out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                                 attention_mask=_NO_MASK, cbnb_batch=batch, **kwargs)
            logits = out.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, rows)
        prompt_lps = _prompt_logprobs(logits[len(batch.logits_indices):], targets) if extra else {}
        logits = logits[:len(batch.logits_indices)]
        t3 = time.perf_counter()
        entries = batch.sample_entries
        toks, report = self.sampler.sample(logits, entries)
        tokens, logprobs, invalid = unpack(entries, toks.tolist(), report.data.tolist(), report.max_logprobs)
        t4 = time.perf_counter()
        timings.update(prepare=t2 - t1, forward=t3 - t2, sample=t4 - t3)
        return StepResult(tokens, timings, copied, logprobs=logprobs, invalid=invalid, prompt_logprobs=prompt_lps)

    def _linears(self) -> Any:
        """The eager CPU forward's linears through oneDNN (`cbnb.runner.cpu.cpu_linear`; off with the CPU fast path)."""
        if self._onednn is None:
            with _ACTIVE_LOCK:
                self._onednn = self.device.type == "cpu" and _route_cpu(self.model)
        return cpu_linear.onednn() if self._onednn else contextlib.nullcontext()


def _route_cpu(model: Any) -> bool:
    """Give the model the CPU fast path's linears (`cbnb.runner.cpu.cpu_linear`) and decoder layers
    (`cbnb.runner.cpu.cpu_layers`); returns whether any linear takes oneDNN."""
    onednn = cpu_linear.route(model) > 0
    cpu_layers.route(model)
    return onednn


def _prompt_logprob_rows(entries: list, batch: Any) -> tuple[list[int], list[tuple[str, int, int, int]]]:
    """The flat-batch rows whose logits give prompt logprobs: for each request that asks, the rows of its chunk at
    prompt positions p (p + 1 < prompt length, p + 1 not yet recorded), predicting the prompt token at p + 1.
    Returns (rows, [(request id, position p + 1, target token, k)] in the same order)."""
    rows: list[int] = []
    targets: list[tuple[str, int, int, int]] = []
    a = 0
    for s in entries:
        req = s.request
        recorded = req.prompt_logprobs
        if recorded is not None:
            prompt = req.prompt_ids
            for p in range(max(s.start, len(recorded)), min(s.end, len(prompt) - 1)):
                rows.append(a + p - s.start)
                targets.append((req.request_id, p + 1, int(prompt[p + 1]), int(req.prompt_logprobs_k or 0)))
        a += s.end - s.start
    return rows, targets


def _prompt_logprobs(logits: torch.Tensor, targets: list[tuple[str, int, int, int]]) -> dict[str, list]:
    """request id -> [(position, TokenLogprob)] from the raw logits of the prompt rows (float32 log_softmax)."""
    from ..core.requests import TokenLogprob

    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor([t[2] for t in targets], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k_max = min(max(t[3] for t in targets), lp.shape[-1])
    top_v, top_i = (lp.topk(k_max, dim=-1) if k_max else (None, None))
    top_v = top_v.tolist() if k_max else None
    top_i = top_i.tolist() if k_max else None
    out: dict[str, list] = {}
    for r, (rid, pos, tok, k) in enumerate(targets):
        top = tuple(zip(top_i[r][:k], top_v[r][:k])) if k else ()
        out.setdefault(rid, []).append((pos, TokenLogprob(tok, chosen[r], top)))
    return out
