"""`torch.compile` of the model forward, honouring transformers' compile knobs, with a fallback to eager.

Which config (transformers' `resolve_compile_configs` order): an explicit `varlen_compile_config` /
`decode_compile_config` (a dict or a transformers `CompileConfig`), else `default_compile_level` 1 (mode "default",
dynamic), 2 ("max-autotune-no-cudagraphs", dynamic) or 3 (the same, static shapes), else the model config's
`compile_config`, else none (eager, the default). ``fullgraph`` comes from the config (transformers' level defaults
say False); cbnb's attention never breaks the graph. Pure-decode steps (every row one token) run the decode config,
the others the varlen config; equal configs share one compiled forward.

How: the paged attention is a custom op (``cbnb::paged_attention``, defined in `cbnb.runner.cpu.attention`, so this
module imports attention and never the other way round) that the compiler treats as opaque; its eager body is
`paged_attention_forward` with the step's `StepBatch`, which the runner publishes in a thread-local for the
duration of the forward (a `StepBatch` argument would make the compiler guard on its Python structure and
recompile every step). Everything else (norms, rotary, MLP, residuals, LM head) is traced and fused.

Cost: compiling SmolLM2 takes tens of seconds to minutes on a small CPU, once per process and shape class (with
``dynamic=True``: a step with one token and a step with one sampled row each compile once more, as torch
specializes sizes 0 and 1). `CompiledForward.stats` reports the compiles and their seconds. A compile (or a
compiled run) that fails warns once and the forward runs eagerly from then on; the step is rerun eagerly (its K/V
writes are idempotent), so the engine never dies of it.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from typing import Any

import torch

from .attention import current_batch, step_local as attention_local  # noqa: F401 (current_batch re-exported)

__all__ = ["resolve_compile_configs", "compile_kwargs", "CompiledForward", "compiled_forward", "current_batch"]

_LEVEL_MODES = {1: ("default", True), 2: ("max-autotune-no-cudagraphs", True), 3: ("max-autotune-no-cudagraphs", False)}
_KWARGS = ("fullgraph", "dynamic", "backend", "mode", "options")
# The step's batch for the opaque op lives with the op (`cbnb.runner.cpu.attention`): this module publishes it there.
_local = attention_local


def _as_dict(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, dict):
        return dict(cfg)
    if hasattr(cfg, "to_dict"):
        return dict(cfg.to_dict())
    return {k: getattr(cfg, k) for k in _KWARGS if hasattr(cfg, k)}


def resolve_compile_configs(config: Any, model: Any = None) -> tuple[dict | None, dict | None]:
    """(varlen, decode) compile configs as dicts (None: eager), in transformers' priority order (module docstring)."""
    level = int(getattr(config, "default_compile_level", 0) or 0)
    fallback = getattr(getattr(model, "config", None), "compile_config", None)
    out = []
    for explicit in (config.varlen_compile_config, config.decode_compile_config):
        if explicit is not None:
            out.append(_as_dict(explicit))
        elif level > 0:
            mode, dynamic = _LEVEL_MODES[level]
            out.append({"mode": mode, "fullgraph": False, "dynamic": dynamic})
        elif fallback is not None:
            out.append(_as_dict(fallback))
        else:
            out.append(None)
    return out[0], out[1]


def compile_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `torch.compile` keyword arguments of a compile config dict (other CompileConfig fields are dropped)."""
    kw = {k: cfg[k] for k in _KWARGS if cfg.get(k) is not None}
    if kw.get("mode") and kw.get("options"):
        kw.pop("mode")  # torch.compile accepts one of the two; options are the more specific
    return kw


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompiledForward:
    """The model's logits forward under `torch.compile(**kwargs)`, with compile accounting and eager fallback.

    Call it with ``(input_ids [1, T], position_ids [1, T], logits_to_keep [S] | None, batch)``; returns the
    logits ``[S, vocab]`` (all ``T`` rows when `logits_to_keep` is None).

    Attributes:
        stats: ``{"compiles": n, "compile_s": seconds of the calls that compiled, "calls": n, "failed": reason}``.
    """

    def __init__(self, model: torch.nn.Module, kwargs: dict[str, Any], mask: torch.Tensor) -> None:
        self.model = model
        self.kwargs = dict(kwargs)
        self._mask = mask
        self._fn = torch.compile(self._forward, **self.kwargs)
        self.stats: dict[str, Any] = {"compiles": 0, "compile_s": 0.0, "calls": 0, "failed": None}
        self._lock = threading.Lock()

    def _forward(self, input_ids, position_ids, logits_to_keep):
        kw = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=self._mask,
                         cbnb_compiled=True, **kw)
        return out.logits[0]

    def eager(self, input_ids, position_ids, logits_to_keep, batch) -> torch.Tensor:
        kw = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=self._mask,
                         cbnb_batch=batch, **kw)
        return out.logits[0]

    def __call__(self, input_ids, position_ids, logits_to_keep, batch) -> torch.Tensor:
        if self.stats["failed"] is not None:
            return self.eager(input_ids, position_ids, logits_to_keep, batch)
        with self._lock:  # engines sharing a model share its compiled forward; dynamo's caches are not reentrant
            before = _unique_graphs()
            t0 = time.perf_counter()
            _local.batch = batch
            try:
                if self.kwargs.get("dynamic") is not False:
                    # Sizes 0 and 1 would be specialized (a step with one token or one sampled row would compile
                    # again): unbacked sizes make one graph serve them all.
                    for t, d in ((input_ids, 1), (position_ids, 1), (logits_to_keep, 0)):
                        if t is not None:
                            torch._dynamo.decorators.mark_unbacked(t, d)
                logits = self._fn(input_ids, position_ids, logits_to_keep)
            except Exception as e:  # a failed compile or compiled run: retry eagerly, then decide
                _local.batch = None
                logits = self.eager(input_ids, position_ids, logits_to_keep, batch)  # raises if the input is bad
                self.stats["failed"] = f"{type(e).__name__}: {e}"[:500]
                warnings.warn(f"cbnb: torch.compile of the forward failed ({self.stats['failed']}); running eagerly "
                              "from now on", RuntimeWarning, stacklevel=2)
                return logits
            finally:
                _local.batch = None
            self.stats["calls"] += 1
            if _unique_graphs() != before:
                self.stats["compiles"] += 1
                self.stats["compile_s"] += time.perf_counter() - t0
        return logits


_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def compiled_forward(model: torch.nn.Module, cfg: dict[str, Any], mask: torch.Tensor) -> CompiledForward:
    """The `CompiledForward` of `model` for this config, shared by every engine of the process (compiled once)."""
    kw = compile_kwargs(cfg)
    key = repr(sorted(kw.items()))
    with _CACHE_LOCK:
        per_model = _CACHE.setdefault(model, {})
        fwd = per_model.get(key)
        if fwd is None:
            fwd = per_model[key] = CompiledForward(model, kw, mask)
    return fwd
