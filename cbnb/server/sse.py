"""Server-sent events and client disconnects.

`EventStream` is an ASGI response that runs a producer coroutine (which sends `data: ...` events through an
`emit` callback) next to a listener for the client's `http.disconnect`: when the client goes away first, the
producer is cancelled at once (its `finally` cancels the engine request, which frees the request's blocks), instead
of noticing only when the next token fails to send. `until_disconnect` does the same for a non-streaming response.

Event format (the OpenAI API's): one ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

__all__ = ["EventStream", "sse", "DONE", "until_disconnect", "ClientGone"]

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first.

    Raises:
        ClientGone: when the client disconnected (after `work` was cancelled and has unwound).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


class EventStream:
    """An ASGI `text/event-stream` response fed by `produce(emit)`.

    Args:
        produce: ``async def produce(emit)``; ``await emit(b"...")`` sends bytes to the client. It is cancelled
            (asyncio.CancelledError at its current await) when the client disconnects.
        on_close: called once when the response ends, whatever the reason (``on_close(client_gone: bool)``).
    """

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
                 on_close: Callable[[bool], None] | None = None, headers: dict[str, str] | None = None) -> None:
        self.produce = produce
        self.on_close = on_close
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        gone = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]
                        + [(k.encode(), v.encode()) for k, v in self.headers.items()]})

            async def emit(data: bytes) -> None:
                await send({"type": "http.response.body", "body": data, "more_body": True})

            try:
                await until_disconnect(receive, self.produce(emit))
            except ClientGone:
                gone = True
                return
            except OSError:  # the transport broke while sending
                gone = True
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self.on_close is not None:
                self.on_close(gone)
