"""Request handles and streaming (torch-free): what `Engine.submit` returns, and the table the loop delivers to.

A `RequestHandle` is the caller's side of one request: iterate it (sync or ``async for``) for `TokenDelta`s, or wait
for its `RequestOutput` with `result()`. The engine thread pushes token ids into the handle's queue without bound
(the loop never waits on a consumer); text is decoded on the consumer's side, incrementally
(`cbnb.engine.detok.IncrementalDetokenizer`: a short tail window per delta, an incomplete UTF-8 tail held back), and so
is the final `RequestOutput` (built from the terminal request when first asked): a streamed request's final text is
its stream's, so no token is decoded twice.

Waiting and interrupts: a ``KeyboardInterrupt`` (a notebook's interrupt button) that arrives while the caller waits
in `result()` or in a sync iteration cancels the request, then propagates; a `result()` timeout leaves the request
running (`Engine.generate` cancels its own requests on a timeout or an interrupt).

`HandleTable` maps request ids to live handles for the loop; a handle leaves it when its request is terminal.
"""

from __future__ import annotations

import _thread
import asyncio
import numbers
import queue
import threading
import weakref
from typing import Any, Callable, Iterator

from .detok import IncrementalDetokenizer
from ..core.requests import Request, RequestOutput, RequestState, TokenDelta

__all__ = ["RequestHandle", "HandleTable", "check_timeout"]

_FINAL = object()


def check_timeout(timeout: Any, name: str = "timeout") -> float | None:
    """`timeout` as seconds (None: wait without limit).

    Raises:
        ValueError: naming `name`, unless it is None or a number >= 0.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 or None; got {timeout!r}")
    return float(timeout)


class RequestHandle:
    """A submitted request: iterate it for `TokenDelta`s, or wait for its `RequestOutput`.

    Iteration (sync or async) consumes the stream once: once the final delta has been yielded, iterating again
    yields nothing. `result()` can be called any number of times (it returns the same object).

    Args:
        request: the submitted request. Once it is terminal, the handle builds its `RequestOutput` from it (and
            decodes its text) on the caller's side, when first asked.
        tokenizer: decodes streamed and final text (None: outputs carry no text).
        cancel: the engine's ``cancel(request_id) -> bool``; held weakly, so a handle never keeps an engine alive.

    Attributes:
        request_id, prompt_token_ids: the request's id and prompt.
        max_new_tokens: its generation limit in tokens, after the cap of the model's max positions (None: unbounded).
    """

    def __init__(self, request: Request, tokenizer: Any = None,
                 cancel: Callable[[str], bool] | None = None) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = list(request.prompt_ids)
        self.max_new_tokens = request.max_new_tokens
        self._tokenizer = tokenizer
        self._cancel = weakref.WeakMethod(cancel) if hasattr(cancel, "__self__") else (lambda: cancel)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # A lock held until the request is terminal: waiting is one interruptible acquire, and a handle costs
        # no Python-level synchronisation objects (thousands may be live under a submit flood).
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self._lock = _thread.allocate_lock()
        self._ended: Request | None = None  # the terminal request, set by the engine thread
        self._final: RequestOutput | None = None
        self._consumed = False  # the final delta was yielded: a later iteration must not wait for more
        self._notify: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] | None = None  # async iterators
        self._stream: IncrementalDetokenizer | None = None

    # ---------------------------------------------------------------- engine side (engine thread only)
    def _wake(self) -> None:
        if not self._notify:
            return
        with self._lock:
            waiters = list(self._notify or ())
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass  # the consumer's loop is closed

    def _push(self, token_ids: list[int], state: RequestState, logprobs: list | None = None) -> None:
        self._q.put((token_ids, state, logprobs))
        self._wake()

    def _finish(self, request: Request) -> None:
        self._ended = request
        self._done.release()
        self._q.put(_FINAL)
        self._wake()

    # ---------------------------------------------------------------- consumer side
    def done(self) -> bool:
        return self._ended is not None

    def _output(self) -> RequestOutput:
        with self._lock:
            if self._final is None:
                req = self._ended
                assert req is not None
                req.decode_text(self._tokenizer)
                self._final = req.output()
            return self._final

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request is terminal and return its output.

        A KeyboardInterrupt while waiting cancels the request, then propagates.

        Raises:
            TimeoutError: when `timeout` seconds pass first (the request goes on).
            ValueError: a `timeout` that is not None or a number >= 0.
        """
        timeout = check_timeout(timeout)
        if self._ended is None:
            try:
                finished = self._done.acquire(True, -1 if timeout is None else timeout)
            except KeyboardInterrupt:
                self.cancel()
                raise
            if not finished:
                raise TimeoutError(f"request {self.request_id!r} not finished after {timeout:.3g} s (it goes on)")
            self._done.release()  # let every other waiter through too
        return self._output()

    def cancel(self) -> bool:
        """Cancel this request. True: its terminal output is CANCELLED and no token reaches this handle after this
        call returns. False when it already ended (or its engine is gone)."""
        cancel = self._cancel()
        if cancel is None or self.done():
            return False
        return cancel(self.request_id)

    def _delta(self, item: Any) -> TokenDelta:
        if self._stream is None:
            self._stream = IncrementalDetokenizer(self._tokenizer)
        stream = self._stream
        if item is _FINAL:
            req = self._ended
            done = len(stream.ids)
            shown = stream.text
            rest = list(req.output_ids[done:])
            text = stream.push(rest, final=True)
            if req.finish_reason == "stop":  # the text ends before the stop string, maybe inside a token
                out = self._output()
                text = out.text[len(shown):]
                stream.text = out.text
            else:
                if self._tokenizer is not None and not req.text:
                    req.text = stream.text  # the stream's text is the final text: decoded once
                out = self._output()
            self._consumed = True
            lps = None if out.logprobs is None else out.logprobs[done:]
            return TokenDelta(self.request_id, rest, text, out.state, True, out.error, lps)
        ids, state, lps = item
        return TokenDelta(self.request_id, ids, stream.push(ids), state, False, None, lps)

    def _before_wait(self) -> None:
        """Called before iteration waits for the next item (a simulated engine runs its steps here)."""

    def __iter__(self) -> Iterator[TokenDelta]:
        while not self._consumed:
            self._before_wait()
            try:
                item = self._q.get()
            except KeyboardInterrupt:
                self.cancel()
                raise
            d = self._delta(item)
            yield d
            if d.finished:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._lock:
            if self._notify is None:
                self._notify = []
            self._notify.append((loop, ev))
        try:
            while not self._consumed:
                while True:
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                    d = self._delta(item)
                    yield d
                    if d.finished:
                        return
                await ev.wait()
                ev.clear()
        finally:
            with self._lock:
                self._notify.remove((loop, ev))

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, done={self.done()})"


class HandleTable:
    """Live handles by request id (thread-safe). The loop delivers tokens and final outputs through it."""

    def __init__(self) -> None:
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()

    def add(self, handle: RequestHandle, max_live: int = 0) -> None:
        """Register a new handle.

        Raises:
            ValueError: its request id is already in use.
            queue.Full: `max_live` (> 0) handles are already live (`ContinuousBatchingConfig.max_queue_size`).
        """
        rid = handle.request_id
        with self._lock:
            if rid in self._handles:
                raise ValueError(f"request_id {rid!r} is already in use")
            if max_live and len(self._handles) >= max_live:
                raise queue.Full(f"{len(self._handles)} requests are unfinished and max_queue_size is {max_live}: "
                                 "wait for some to finish or raise ContinuousBatchingConfig.max_queue_size")
            self._handles[rid] = handle

    def get(self, request_id: str) -> RequestHandle | None:
        with self._lock:
            return self._handles.get(request_id)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def __bool__(self) -> bool:
        return bool(self._handles)

    def deliver(self, request_id: str, token_ids: list[int], state: RequestState,
                logprobs: list | None = None) -> None:
        """Stream new tokens (and their `TokenLogprob`s, when asked for) to the request's handle (if it still has
        one)."""
        with self._lock:
            h = self._handles.get(request_id)
        if h is not None:
            h._push(token_ids, state, logprobs)

    def finish_many(self, requests: list[Request]) -> None:
        """`finish` for many requests under one lock (the engine stopping with a long queue)."""
        with self._lock:
            handles = [self._handles.pop(r.request_id, None) for r in requests]
        for h, r in zip(handles, requests):
            if h is not None:
                h._finish(r)

    def finish(self, request: Request) -> None:
        """Hand a terminal request to its handle, which leaves the table."""
        with self._lock:
            h = self._handles.pop(request.request_id, None)
        if h is not None:
            h._finish(request)
