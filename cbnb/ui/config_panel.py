"""`ConfigPanel`: sliders, dropdowns and toggles for the engine's `ContinuousBatchingConfig`, with a live memory
preview and the config as ready-to-paste transformers code. "Apply" reconfigures the engine at once, also mid-run,
with `engine.reconfigure`: unfinished requests are kept and their KV is recomputed in the new cache (nothing queued
is lost). A "keep cache bytes fixed" lock rescales num_blocks when page_size changes."""

from __future__ import annotations

import threading
import time
from typing import Any

import traitlets

from ..core.config import SCHEDULER_TYPES
from . import _assets
from .base import Panel
from .poller import Frame
from .state import fmt_bytes

__all__ = ["ConfigPanel", "FIELDS", "values_from_config", "config_from_values", "proposed_config"]

_PAGE_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]

#: The controls, in display order. kind: "select" (options), "range" (min/max/step), "toggle", "radio"; group: the
#: column they are shown in ("cache" or "scheduling"); cuda_only: no effect without CUDA (folded away on CPU).
FIELDS: list[dict[str, Any]] = [
    {"name": "page_size", "group": "cache", "kind": "select", "options": _PAGE_SIZES, "unit": "tokens",
     "help": "Tokens per KV page. Small pages waste less in half-filled tails; large ones mean fewer blocks."},
    {"name": "sizing", "group": "cache", "kind": "radio", "options": ["num_blocks", "max_memory_percent"],
     "help": "Size the cache by a block count, or by a share of the free memory."},
    {"name": "num_blocks", "group": "cache", "kind": "range", "min": 4, "max": 4096, "step": 4, "unit": "blocks",
     "help": "KV blocks (one page in every layer). More blocks hold more tokens at once, and take more memory."},
    {"name": "max_memory_percent", "group": "cache", "kind": "range", "min": 0.05, "max": 0.95, "step": 0.05, "unit": "fraction",
     "help": "Share of free memory for KV cache + activations + logits, when num_blocks is not set."},
    {"name": "max_batch_tokens", "group": "scheduling", "kind": "range", "min": 16, "max": 4096, "step": 16, "unit": "tokens",
     "help": "Query tokens per step (prompt chunks + one per decoding request). Larger: faster, choppier."},
    {"name": "max_requests_per_batch", "group": "scheduling", "kind": "range", "min": 1, "max": 512, "step": 1, "unit": "requests",
     "help": "Requests in one step at most; also sizes the logits buffer."},
    {"name": "scheduler_type", "group": "scheduling", "kind": "select", "options": list(SCHEDULER_TYPES),
     "help": "fifo: admit in arrival order and keep a safety margin; prefill_first: prompts before decodes; "
             "vllm: vLLM V1's policy (decodes first, strict arrival order, newest recomputed when the cache is full)."},
    {"name": "safety_margin", "group": "scheduling", "kind": "range", "min": 0.0, "max": 0.5, "step": 0.01, "unit": "fraction",
     "help": "Share of the cache kept free before new requests are admitted (fifo default 0.15)."},
    {"name": "allow_block_sharing", "group": "cache", "kind": "toggle",
     "help": "Prefix cache: requests with the same prompt start share its KV blocks instead of recomputing."},
    {"name": "cpu_offload_space", "group": "cache", "kind": "range", "min": 0.0, "max": 8.0, "step": 0.25, "unit": "GiB",
     "help": "Host swap pool for requests pushed out of a full cache; 0: soft reset (recompute) instead."},
    {"name": "q_padding_interval_size", "group": "scheduling", "cuda_only": True, "kind": "range", "min": 0, "max": 512, "step": 16, "unit": "tokens",
     "help": "Query length padded to a multiple of this (fewer CUDA-graph shapes); 0: the preset, 64."},
    {"name": "kv_padding_interval_size", "group": "scheduling", "cuda_only": True, "kind": "range", "min": 0, "max": 65536, "step": 1024, "unit": "tokens",
     "help": "KV length padded to a multiple of this (fewer CUDA-graph shapes); 0: the preset, 16384."},
    {"name": "use_cuda_graph", "group": "scheduling", "cuda_only": True, "kind": "toggle",
     "help": "Capture a CUDA graph per padded batch shape and replay it (CUDA only; no effect on CPU)."},
    {"name": "use_async_batching", "group": "scheduling", "cuda_only": True, "kind": "toggle",
     "help": "Prepare the next batch on the CPU while the GPU runs this one (CUDA only; no effect on CPU)."},
]
FIELD_NAMES = [f["name"] for f in FIELDS]


def values_from_config(cfg: Any) -> dict[str, Any]:
    """The panel's values for a (resolved) `ContinuousBatchingConfig`."""
    explicit = cfg.num_blocks is not None
    mmp = cfg.max_memory_percent if cfg.max_memory_percent is not None else 0.6
    graphs = cfg.use_cuda_graph
    return {
        "page_size": int(cfg.page_size),
        "sizing": "num_blocks" if explicit else "max_memory_percent",
        "num_blocks": int(cfg.num_blocks) if explicit else 256,
        "max_memory_percent": float(mmp),
        "max_batch_tokens": int(cfg.max_batch_tokens or 512),
        "max_requests_per_batch": int(cfg.max_requests_per_batch or 256),
        "scheduler_type": cfg.scheduler_type,
        "safety_margin": float(cfg.effective_safety_margin),
        "allow_block_sharing": bool(cfg.allow_block_sharing),
        "cpu_offload_space": float(cfg.cpu_offload_space or 0.0),
        "q_padding_interval_size": int(cfg.q_padding_interval_size),
        "kv_padding_interval_size": int(cfg.kv_padding_interval_size),
        "use_cuda_graph": bool(any(cfg.cuda_graph_booleans)) if graphs is not None else False,
        "use_async_batching": bool(cfg.use_async_batching),
    }


def config_from_values(base: Any, values: dict[str, Any]) -> Any:
    """A new `ContinuousBatchingConfig`: `base` with the panel's `values` applied.

    Raises:
        ValueError: a value outside its field's range (the message names the field).
    """
    v = dict(values_from_config(base), **values)
    unknown = set(values) - set(FIELD_NAMES)
    if unknown:
        raise ValueError(f"unknown config field(s): {', '.join(sorted(unknown))}")

    def as_int(name: str) -> int:
        try:
            f = float(v[name])
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number; got {v[name]!r}") from None
        if f != int(f):
            raise ValueError(f"{name} must be a whole number; got {v[name]!r}")
        return int(f)

    def as_float(name: str) -> float:
        try:
            return float(v[name])
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number; got {v[name]!r}") from None

    if v["sizing"] not in ("num_blocks", "max_memory_percent"):
        raise ValueError(f"sizing must be 'num_blocks' or 'max_memory_percent'; got {v['sizing']!r}")
    by_blocks = v["sizing"] == "num_blocks"
    return base.copy(
        page_size=as_int("page_size"),
        num_blocks=as_int("num_blocks") if by_blocks else None,
        max_memory_percent=as_float("max_memory_percent"),
        max_batch_tokens=as_int("max_batch_tokens"),
        max_requests_per_batch=as_int("max_requests_per_batch"),
        scheduler_type=str(v["scheduler_type"]),
        safety_margin=as_float("safety_margin"),
        allow_block_sharing=bool(v["allow_block_sharing"]),
        cpu_offload_space=as_float("cpu_offload_space"),
        q_padding_interval_size=as_int("q_padding_interval_size"),
        kv_padding_interval_size=as_int("kv_padding_interval_size"),
        use_cuda_graph=bool(v["use_cuda_graph"]),
        use_async_batching=bool(v["use_async_batching"]),
    )


_CONFIG_ATTRS = ("page_size", "num_blocks", "max_memory_percent", "max_batch_tokens", "max_requests_per_batch",
                 "scheduler_type", "safety_margin", "allow_block_sharing", "cpu_offload_space",
                 "q_padding_interval_size", "kv_padding_interval_size", "use_cuda_graph", "use_async_batching")


def _same(name: str, a: Any, b: Any) -> bool:
    if name == "use_cuda_graph":  # True == (True, True); None/False == (False, False)
        def flat(v: Any) -> bool:
            return bool(any(v)) if isinstance(v, (tuple, list)) else bool(v)
        return flat(a) == flat(b)
    return a == b


def changed_fields(before: Any, after: Any, asked: Any = None) -> str:
    """Every resolved field that differs between two configs, e.g. "max_batch_tokens 256 -> 512, and with it
    max_requests_per_batch 32 -> 64 (left automatic)": the fields `asked` (the applied user config) set first, then
    those that followed ("" when none changed)."""
    diffs = [(k, getattr(before, k, None), getattr(after, k, None)) for k in _CONFIG_ATTRS
             if not _same(k, getattr(before, k, None), getattr(after, k, None))]
    mine = [d for d in diffs if asked is None or getattr(asked, d[0], None) is not None]
    auto = [d for d in diffs if d not in mine]
    text = ", ".join(f"{k} {a} -> {b}" for k, a, b in mine)
    if auto:
        text += (", and with it " if text else "") + ", ".join(f"{k} {a} -> {b}" for k, a, b in auto) + \
            " (left automatic: resolved from the others)"
    return text


def proposed_config(user: Any, resolved: Any, values: dict[str, Any]) -> Any:
    """The config to apply: the engine's own (unresolved) config `user` plus the fields the panel changed
    relative to the engine's `resolved` config, so that untouched `None` fields keep resolving automatically
    (e.g. max_requests_per_batch follows a new max_batch_tokens).

    Raises:
        ValueError: a value outside its field's range (the message names the field).
    """
    cand = config_from_values(resolved, values)
    changes = {k: getattr(cand, k) for k in _CONFIG_ATTRS if not _same(k, getattr(cand, k), getattr(resolved, k))}
    if values.get("sizing") == "num_blocks" and "num_blocks" not in changes and user.num_blocks is None:
        changes["num_blocks"] = cand.num_blocks  # switching to an explicit size at the current block count
    return user.copy(**changes)


class ConfigPanel(Panel):
    """Retune the engine: Apply reconfigures at once, also mid-run (unfinished requests are kept and recompute their
    KV in the new cache).

    Every change of `values` (from the controls or from Python) recomputes, without allocating anything:
    the proposed config (`engine.plan_memory`), its memory split next to the current one, and the
    transformers code for it. `apply()` works on a worker thread, so the kernel stays responsive: it calls
    `engine.reconfigure` (unfinished requests are carried into the new cache; with `wait_for_idle` it first waits
    for them to finish under the current config) and starts a new statistics run (`engine.reset_stats()`), so the plots'
    "this run" figures belong to the new config.

    Synced state:
        fields: the control specs (`FIELDS`, with ranges widened to include current values).
        values: the values being edited (see `values_from_config`).
        applied: the engine's current values.
        code: ready-to-paste ``ContinuousBatchingConfig(...)`` code for `values`.
        memory: {"proposed": split, "current": split (bytes), "num_blocks", "capacity_tokens", "budget_bytes",
            "error"}.
        busy: True while a reconfigure runs.
        device: the engine's device type ("cpu", "cuda", ...).
        lock_bytes: keep the cache's bytes fixed: a page_size change rescales num_blocks so that num_blocks x
            page_size (the tokens, hence the bytes, of the usable cache) stays the same; only the two reserved
            padding blocks follow the page size.
        code is "" while the values are invalid (the error is in memory["error"]), never the code of older values.
    """

    _esm = _assets.esm("config.js")
    fields = traitlets.List().tag(sync=True)
    values = traitlets.Dict().tag(sync=True)
    applied = traitlets.Dict().tag(sync=True)
    code = traitlets.Unicode("").tag(sync=True)
    memory = traitlets.Dict().tag(sync=True)
    busy = traitlets.Bool(False).tag(sync=True)
    device = traitlets.Unicode("cpu").tag(sync=True)
    applied_count = traitlets.Int(0).tag(sync=True)
    lock_bytes = traitlets.Bool(False).tag(sync=True)

    #: Wait until the engine has no unfinished request before reconfiguring. Off by default: `Engine.reconfigure`
    #: carries unfinished requests into the new cache (they recompute their KV there), so nothing is lost either way.
    wait_for_idle = False

    def _setup(self) -> None:
        self._config_seen = None
        self._apply_thread: threading.Thread | None = None
        self.device = getattr(getattr(self.engine, "device", None), "type", "cpu")
        self._sync_from_engine()
        self.observe(self._on_values, names="values")
        self._preview()

    # ------------------------------------------------------------------------------------------ state
    def _sync_from_engine(self) -> None:
        cfg = self.engine.config
        self._config_seen = cfg
        vals = values_from_config(cfg)
        fields = []
        for f in FIELDS:
            f = dict(f)
            if f["kind"] == "range":  # widen the range so that the current value is on the slider
                f["max"] = max(f["max"], vals[f["name"]] * 2 if f["name"] == "num_blocks" else vals[f["name"]])
                f["min"] = min(f["min"], vals[f["name"]])
            if f["kind"] == "select" and vals[f["name"]] not in f["options"]:
                f["options"] = sorted(set(f["options"]) | {vals[f["name"]]})
            fields.append(f)
        with self.hold_sync():
            self.fields = fields
            self.applied = vals
            self.values = dict(vals)

    def candidate(self) -> Any:
        """The `ContinuousBatchingConfig` the controls describe.

        Raises:
            ValueError: when a value is out of range (the message names the field).
        """
        eng = self.engine
        return proposed_config(getattr(eng, "user_config", eng.config), eng.config, self.values)

    def _preview(self) -> None:
        current = self.engine.memory_split()
        mem: dict[str, Any] = {"current": current, "error": ""}
        try:
            cand = self.candidate()
            resolved, plan, swap = self.engine.plan_memory(cand)
            split = plan.split()
            split["swap_pool"] = swap * plan.cache_bytes // max(1, plan.num_sectors + 2) if swap else 0
            mem.update(proposed=split, num_blocks=plan.num_blocks, capacity_tokens=plan.capacity_tokens,
                       budget_bytes=plan.budget_bytes, free_bytes=plan.free_bytes,
                       text=(f"{plan.num_blocks} blocks x {resolved.page_size} tokens = {plan.capacity_tokens:,} "
                             f"tokens; KV {fmt_bytes(split['kv_cache'])}, activations "
                             f"{fmt_bytes(split['activations'])}, logits {fmt_bytes(split['logits'])}"
                             + (f", CUDA graphs {fmt_bytes(split['cuda_graphs'])}" if split.get("cuda_graphs") else
                                "")))
            code = cand.to_code()
        except (ValueError, MemoryError) as e:
            mem["error"] = str(e)
            code = ""  # never the code of older values: it would not be what the controls say
        with self.hold_sync():
            self.memory = mem
            self.code = code

    def _on_values(self, change: Any) -> None:
        old, new = change.get("old") or {}, change.get("new") or {}
        if self.lock_bytes and old.get("page_size") and new.get("page_size") != old.get("page_size") \
                and new.get("sizing") == "num_blocks" and new.get("num_blocks") == old.get("num_blocks"):
            try:
                blocks = max(1, round(int(old["num_blocks"]) * int(old["page_size"]) / int(new["page_size"])))
            except (TypeError, ValueError, ZeroDivisionError):
                blocks = None
            if blocks is not None and blocks != new.get("num_blocks"):
                self._widen("num_blocks", blocks)
                self.values = dict(new, num_blocks=blocks)  # observed again: previews then
                self.show(f"Cache bytes kept: page_size {old['page_size']} -> {new['page_size']}, num_blocks "
                          f"{old['num_blocks']} -> {blocks} ({blocks * int(new['page_size']):,} tokens).", "info")
                return
        self._preview()

    def _widen(self, name: str, value: float) -> None:
        """Widen a range control so that `value` is on it."""
        fields = []
        for f in self.fields:
            if f["name"] == name and f["kind"] == "range" and not (f["min"] <= value <= f["max"]):
                f = dict(f, min=min(f["min"], value), max=max(f["max"], value))
            fields.append(f)
        self.fields = fields

    # ------------------------------------------------------------------------------------------ actions
    def set(self, **values: Any) -> None:
        """Change some values (as the controls would), e.g. ``panel.set(max_batch_tokens=512)``."""
        self.values = dict(self.values, **values)

    def _on_lock(self, msg: dict) -> None:
        self.lock_bytes = bool(msg.get("on"))

    def reset(self) -> None:
        """Discard the edits: back to the engine's current config."""
        self._sync_from_engine()
        self._preview()
        self.show("Edits discarded.", "info")

    def apply(self, wait: bool = False, timeout: float = 120.0) -> bool:
        """Reconfigure the engine with the edited values (on a worker thread).

        Args:
            wait: block until the engine has switched (or failed).
            timeout: seconds `wait` waits at most.

        Returns:
            False when the values are invalid or an apply is already running (shown on the panel); True once
            started (with `wait`, True only when it succeeded).
        """
        if self.busy:
            self.show("An apply is already running.", "info")
            return False
        try:
            cfg = self.candidate()
            self.engine.plan_memory(cfg)
        except (ValueError, MemoryError) as e:
            self.show(f"Not applied: {e}", "error")
            return False
        self.busy = True
        self.show("Applying… unfinished requests are kept; their KV is recomputed in the new cache.", "info")
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                if self.wait_for_idle:
                    self._wait_idle(timeout)
                live = [r for r in self.engine.requests_snapshot() if not r.finished]
                tokens = sum(len(r.prompt_token_ids) + len(r.token_ids) for r in live)
                before = self.engine.config
                resolved = self.engine.reconfigure(cfg, timeout=timeout)
                self.engine.reset_stats(marker=False)  # reconfigure marked the new run already
                result["ok"] = True
                kept = (f"{len(live)} unfinished request{'s' if len(live) != 1 else ''} kept, their KV "
                        f"({tokens:,} tokens) recomputed in the new cache" if live else "no request was running")
                what = changed_fields(before, resolved, cfg) or "no field changed (a fresh cache)"
                self.show(f"Applied at once: {what}; {kept}.", "ok")
            except Exception as e:
                self.show(f"Not applied ({type(e).__name__}): {e}", "error")
            finally:
                self._sync_from_engine()
                self._preview()
                self.applied_count += 1
                self.busy = False
                self.poller.poke()

        t = threading.Thread(target=work, name="cbnb-ui-apply", daemon=True)
        self._apply_thread = t
        t.start()
        if wait:
            t.join(timeout)
            return bool(result.get("ok"))
        return True

    def _wait_idle(self, timeout: float) -> None:
        """Block (worker thread) until no request is unfinished, showing how many are left.

        Raises:
            TimeoutError: when `timeout` seconds pass first.
        """
        deadline = time.monotonic() + timeout
        shown = -1
        while True:
            live = sum(1 for r in self.engine.requests_snapshot() if not r.finished)
            if live == 0:
                return
            if live != shown:
                shown = live
                self.show(f"Waiting for {live} unfinished request(s) to end before applying (they finish under "
                          f"the current config; nothing is lost)…", "info")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{live} request(s) still unfinished after {timeout:.0f} s; cancel them or "
                                   "apply later")
            time.sleep(0.05)

    def _on_apply(self, msg: dict) -> None:
        if isinstance(msg.get("values"), dict):
            self.values = dict(self.values, **msg["values"])
        self.apply()

    def _on_reset(self, _msg: dict) -> None:
        self.reset()

    # ------------------------------------------------------------------------------------------ poller
    def _needs(self) -> set[str]:
        return set()

    def _update(self, frame: Frame) -> None:
        # The config can change outside the panel (engine.reconfigure from a cell): follow it.
        if self.engine.config is not self._config_seen and not self.busy:
            with self._lock:
                self._sync_from_engine()
                self._preview()
