"""One generation request's run: the engine handle's deltas -> text pieces (stop strings applied) -> an OpenAI
response body or a stream of chunks (one per text delta, then finish_reason, usage when asked, [DONE])."""

from __future__ import annotations

import time
from typing import Any, Callable

from .counters import ServerCounters
from .protocol import ApiError, GenerationRequest
from .sse import DONE, sse
from .stops import StopMatcher

__all__ = ["Generation", "Slot"]

_FINISH = {"eos": "stop", "length": "length", "stop": "stop"}


class Slot:
    """One of `max_concurrent_requests` places, counted in `ServerCounters`; released exactly once."""

    def __init__(self, counters: ServerCounters, client: str) -> None:
        self.counters, self.client, self.tokens, self._held = counters, client, 0, True
        counters.on_start(client)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.counters.on_end(self.client, self.tokens)


class Generation:
    """Consumes one request's deltas for a streamed or a collected response.

    Args:
        handle: the engine's `RequestHandle`.
        g: the parsed request.
        slot: its concurrency `Slot` (released by `close`).
        model_name: the served model id, echoed in responses.
        live: the server's map of live handles (this request is removed from it by `close`).
        closing: returns True while the server is stopping (explains a cancellation).
    """

    def __init__(self, handle: Any, g: GenerationRequest, slot: Slot, model_name: str, live: dict[str, Any],
                 closing: Callable[[], bool]) -> None:
        self.handle, self.g, self.slot, self.model_name, self.live, self.closing = (
            handle, g, slot, model_name, live, closing)
        self.matcher = StopMatcher(g.stop) if g.stop else None
        self.id = ("cmpl-" if g.kind == "completion" else "chatcmpl-") + handle.request_id
        self.created = int(time.time())
        self.prompt_tokens = len(handle.prompt_token_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.text: list[str] = []

    async def pieces(self):
        """Text pieces to send, in order; sets finish_reason or error at the end."""
        it = self.handle.__aiter__()
        try:
            async for d in it:
                self.completion_tokens += len(d.token_ids)
                self.slot.tokens = self.completion_tokens
                text = d.text
                if self.matcher is not None:
                    text = self.matcher.push(text)
                    if self.matcher.stopped:
                        self.finish_reason = "stop"
                        self.handle.cancel()  # stop strings live in the server for now: end the engine request
                        if text:
                            yield text
                        return
                    if d.finished:
                        text += self.matcher.flush()
                if d.finished:
                    self._outcome(d)
                if text:
                    yield text
        finally:
            await it.aclose()

    def _outcome(self, d: Any) -> None:
        out = self.handle.result(timeout=0)
        if out.state.name == "FINISHED":
            self.finish_reason = _FINISH.get(out.finish_reason or "", "stop")
        elif out.state.name == "CANCELLED":
            why = out.error or ("the server is stopping" if self.closing() else "the request was cancelled")
            self.error = ApiError(503, f"request cancelled: {why}", type="server_error", code="request_cancelled")
        else:
            self.error = ApiError(500, f"request failed: {out.error}", type="server_error", code="request_failed")

    async def collect(self) -> None:
        async for piece in self.pieces():
            self.text.append(piece)

    def close(self) -> None:
        """Cancel the engine request if it is still running (client gone, error) and free the slot."""
        if not self.handle.done():
            self.handle.cancel()
        self.live.pop(self.handle.request_id, None)
        self.slot.release()

    # -------------------------------------------------------------------------------- response bodies
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name,
                "system_fingerprint": None}

    def response(self) -> dict[str, Any]:
        text = "".join(self.text)
        if self.g.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": self.finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.g.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            c = {**self._head("text_completion"), "choices": [choice]}
        else:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            c = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.g.include_usage:
            c["usage"] = self.usage() if self.g.continuous_usage else None
        return c

    async def stream(self, emit: Callable[[bytes], Any]) -> None:
        """Send one chunk per text delta, a last chunk with finish_reason, the usage chunk if asked, [DONE]."""
        if self.g.kind == "chat":
            await emit(sse(self._chunk("", None, first=True)))
        async for piece in self.pieces():
            await emit(sse(self._chunk(piece, None)))
        if self.error is not None:
            await emit(sse(self.error.body()))
        else:
            await emit(sse(self._chunk(None if self.g.kind == "chat" else "", self.finish_reason)))
        if self.g.include_usage:
            obj = "text_completion" if self.g.kind == "completion" else "chat.completion.chunk"
            await emit(sse({**self._head(obj), "choices": [], "usage": self.usage()}))
        await emit(DONE)
