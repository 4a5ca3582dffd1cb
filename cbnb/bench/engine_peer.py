"""Peers for A/B runs from a notebook: transformers' own continuous batching behind cbnb's engine-like API.

::

    from cbnb.bench.engine_peer import HFContinuousBatching, compare_outputs
    with HFContinuousBatching(model, config, max_new_tokens=max(wl.max_new_tokens)) as hf:
        hf_run = run_workload(hf, wl, log=engine.runs)       # same workload, same arrival times, same run log
    compare_outputs(cbnb_run, hf_run)                         # greedy tokens, request by request

`HFContinuousBatching` starts transformers' manager with `cbnb.bench.peers.hf_cb_manager` (the same setup as the
``hf-cb`` peer of ``python -m cbnb.bench``: `config.to_transformers()`, greedy, EOS off), submits with
``add_request(..., record_timestamps=True)``, and reads results on one thread. Timings come from transformers'
own marks (perf_counter seconds, the driver's wall clock): queued = ``created_time``, scheduled = ``lifespan[0]``,
finished = ``lifespan[1]``, token times = ``timestamps``.

It lives with the bench's peers (`cbnb.bench.peers`: the peer registry and its set-up), the one place that runs
peers; the tuning lab drives it like any engine-like object (`cbnb.lab.tuning.run_workload`).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ..core.requests import RequestOutput, RequestState, RequestTimings

__all__ = ["HFContinuousBatching", "compare_outputs"]


class _HFHandle:
    def __init__(self, owner: "HFContinuousBatching", rid: str, prompt: list[int]) -> None:
        self.request_id = rid
        self.prompt_token_ids = prompt
        self._owner = owner
        self._done = threading.Event()
        self._out: RequestOutput | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} not finished after {timeout} s")
        assert self._out is not None
        return self._out

    def cancel(self) -> bool:
        if self.done():
            return False
        self._owner.manager.cancel_request(self.request_id)
        return True

    def _finish(self, out: RequestOutput) -> None:
        self._out = out
        self._done.set()


class HFContinuousBatching:
    """transformers' continuous batching as an engine-like object (``submit`` / handles / ``user_config``).

    Args:
        model: the same transformers model the cbnb engine runs.
        config: the cbnb `ContinuousBatchingConfig` (passed as `config.to_transformers()`).
        max_new_tokens: the generation config's default (each request passes its own too).
        share_with: a running `cbnb.Engine` on the same model: it is stopped (after finishing its requests) while
            transformers runs, because a running cbnb engine routes the model's attention through its paged
            kernels, and restarted by `stop()`.

    Attributes:
        engine_name: "hf-cb" (how the run log names this engine).

    Prompts must be token ids (transformers' `add_request` takes ids).

    Raises:
        RuntimeError: at start, when a running cbnb engine holds the model and was not passed as `share_with`.
    """

    engine_name = "hf-cb"

    def __init__(self, model: Any, config: Any, *, max_new_tokens: int = 256, share_with: Any = None) -> None:
        self.model = model
        self.user_config = config
        self.config = config
        self._max_new = int(max_new_tokens)
        self._share = share_with
        self._restart = False
        self.manager: Any = None
        self._handles: dict[str, _HFHandle] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> "HFContinuousBatching":
        if self.manager is not None:
            return self
        from .peers import hf_cb_manager

        if self._share is not None and getattr(self._share, "running", False):
            self._share.stop(drain=True)
            self._restart = True
        impl = str(getattr(getattr(self.model, "config", None), "_attn_implementation", "") or "")
        if impl.startswith("cbnb"):
            raise RuntimeError("a running cbnb engine holds this model (its attention is cbnb's paged attention): "
                               "pass it as HFContinuousBatching(..., share_with=engine), or engine.stop() first")
        self.manager = hf_cb_manager(self.model, self.config, self._max_new)
        self._stop.clear()
        self._reader = threading.Thread(target=self._read, name="cbnb-hf-reader", daemon=True)
        self._reader.start()
        return self

    def stop(self) -> None:
        """Stop transformers' manager; requests still open end FAILED ("stopped")."""
        if self.manager is None:
            return
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5)
        self.manager.stop(block=True)
        self.manager = None
        self._fail_open("transformers' manager stopped")
        if self._restart:
            self._restart = False
            self._share.start()

    def _fail_open(self, error: str) -> None:
        with self._lock:
            left = list(self._handles.values())
            self._handles.clear()
        for h in left:
            h._finish(RequestOutput(h.request_id, h.prompt_token_ids, [], state=RequestState.FAILED, error=error))

    def __enter__(self) -> "HFContinuousBatching":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, prompt: Any, max_new_tokens: int | None = None, *, ignore_eos: bool = True,
               request_id: str | None = None, **_: Any) -> _HFHandle:
        """Queue one request (token ids).

        Raises:
            ValueError: a text prompt, or `ignore_eos=False` (the manager is set up with EOS off).
        """
        if isinstance(prompt, str) or not prompt:
            raise ValueError("HFContinuousBatching takes non-empty token-id prompts")
        if not ignore_eos:
            raise ValueError("HFContinuousBatching runs with EOS ignored (as the bench peer); pass ignore_eos=True")
        self.start()
        rid = request_id or f"hf-{next(self._ids)}"
        ids = [int(i) for i in prompt]
        h = _HFHandle(self, rid, ids)
        with self._lock:
            self._handles[rid] = h
        got = self.manager.add_request(ids, request_id=rid, max_new_tokens=max_new_tokens or self._max_new,
                                       record_timestamps=True)
        if got is None:
            with self._lock:
                self._handles.pop(rid, None)
            raise RuntimeError("transformers' manager refused the request (not accepting new requests)")
        return h

    def _read(self) -> None:
        m = self.manager
        while not self._stop.is_set():
            r = m.get_result(timeout=0.1)
            if r is None:
                if not m.is_running():  # transformers' loop died: end what is open, don't spin
                    err = getattr(getattr(m, "background_thread_status", None), "fatal_error", None)
                    self._fail_open(f"transformers' manager stopped: {err}")
                    self._stop.wait(0.1)
                continue
            if not r.is_finished():
                continue
            with self._lock:
                h = self._handles.pop(r.request_id, None)
            if h is not None:
                h._finish(self._output(r, h.prompt_token_ids))

    @staticmethod
    def _output(r: Any, prompt: list[int]) -> RequestOutput:
        ts = list(r.timestamps or [])
        start, end = (r.lifespan or (-1, -1))
        ok = r.error is None
        tokens = list(r.generated_tokens)
        return RequestOutput(
            r.request_id, prompt, tokens, state=RequestState.FINISHED if ok else RequestState.FAILED, error=r.error,
            finish_reason="length" if ok else "error",
            timings=RequestTimings(queued=r.created_time, scheduled=start if start >= 0 else None,
                                   first_token=ts[0] if ts else None, finished=end if end >= 0 else None),
            token_times=ts if len(ts) == len(tokens) else [], max_new_tokens=len(tokens))

    def reset_stats(self) -> None:
        """Nothing to reset (transformers keeps no per-run figures that cbnb reads)."""


def compare_outputs(a: Any, b: Any) -> dict[str, Any]:
    """Greedy tokens of two runs of the same workload, request by request (in workload order).

    Args:
        a, b: `cbnb.telemetry.runs.Run`s (their `records`) or lists of records.

    Returns:
        {"requests": n, "identical": count, "agreement_frac": identical / n,
        "mismatches": [{"index", "first_difference" (token position), "a_tokens", "b_tokens"}]}.

    Raises:
        ValueError: the runs have different request counts.
    """
    ra = list(getattr(a, "records", a))
    rb = list(getattr(b, "records", b))
    if len(ra) != len(rb):
        raise ValueError(f"the runs have {len(ra)} and {len(rb)} requests: not the same workload")
    mism = []
    for x, y in zip(ra, rb):
        ta, tb = list(x.token_ids), list(y.token_ids)
        if ta != tb:
            pos = next((k for k, (p, q) in enumerate(zip(ta, tb)) if p != q), min(len(ta), len(tb)))
            mism.append({"index": x.index, "first_difference": pos, "a_tokens": len(ta), "b_tokens": len(tb)})
    n = len(ra)
    return {"requests": n, "identical": n - len(mism), "agreement_frac": (n - len(mism)) / n if n else 1.0,
            "mismatches": mism}
