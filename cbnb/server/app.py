"""The ASGI application (Starlette): OpenAI-compatible routes over one engine.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`, `GET /metrics`.
Every route but `/health` needs the API key when one is set. Each generation request is an ordinary engine request
(id ``http-N``, source ``"http <host>:<port>"`` of the client, plus ``user=`` when the body names one): the
dashboard's board and the engine's stats show it like any other. Its life:

    body (<= max_body_bytes, else 413) -> JSON object (400) -> schema (400 naming the field) -> model (404)
    -> engine up (503) -> a concurrency slot (429) -> tokenize on the server's worker thread -> prompt and
    max_tokens limits (400) -> engine.submit (429 when its queue is full) -> stream or collect the deltas,
    watching for the client's disconnect (-> the request is cancelled, its blocks freed)

No failure inside one request reaches the engine or another request: each handler turns any exception into an
error response (500 for the unexpected, logged).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import queue
import time
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import protocol
from .counters import ServerCounters
from .metrics import CONTENT_TYPE, EngineCollector, render
from .protocol import ApiError, GenerationRequest
from .settings import ServerSettings
from .generation import Generation, Slot
from .sse import ClientGone, EventStream, until_disconnect

__all__ = ["ServerContext", "build_app"]

log = logging.getLogger("cbnb.server")

_REQUEST_IDS = itertools.count(1)  # process-wide: two servers on one engine never reuse an id
_PUBLIC = {"/health"}


class ServerContext:
    """What the routes share: the engine, the settings, counters, the tokenizer worker and the live requests.

    Args:
        engine: the `cbnb.Engine` to serve.
        settings: `ServerSettings`.
        run_blocking: ``await run_blocking(fn, *args)`` runs `fn` on the server's worker thread (tokenization).
        connections: returns the number of open HTTP connections (for /metrics), or None.
    """

    def __init__(self, engine: Any, settings: ServerSettings, run_blocking: Callable[..., Any],
                 connections: Callable[[], int | None] = lambda: None) -> None:
        import inspect

        self.engine = engine
        self.settings = settings
        self.run_blocking = run_blocking
        self.counters = ServerCounters()
        self.collector = EngineCollector(engine, self.counters, connections)
        self.model_name = settings.model_name or model_name_of(engine)
        self.engine_args = frozenset(inspect.signature(engine.submit).parameters)
        self.live: dict[str, Any] = {}  # request id -> handle, for the requests this server submitted
        self.closing = False
        self.created = int(time.time())

    def close(self) -> None:
        """Refuse new requests and cancel the live ones (called on the server's loop when it stops)."""
        self.closing = True
        for handle in list(self.live.values()):
            handle.cancel()

    @property
    def max_positions(self) -> int | None:
        return getattr(self.engine, "max_positions", None)


def model_name_of(engine: Any) -> str:
    """A model id for `/v1/models`: the model's folder or hub name (last part), else its class name."""
    cfg = getattr(getattr(engine, "model", None), "config", None)
    path = str(getattr(cfg, "_name_or_path", "") or "").rstrip("/")
    if path:
        return path.rsplit("/", 1)[-1]
    return type(getattr(engine, "model", engine)).__name__


# ------------------------------------------------------------------------------------------------ middleware
class Gate:
    """Pure ASGI middleware: counts every response by route and status, checks the API key, refuses bodies whose
    declared length is over the limit (413) before any of it is read."""

    def __init__(self, app: Any, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        key = ctx.settings.api_key
        self._key = key.encode() if key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"
        counters = self.ctx.counters

        async def counted(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                counters.on_response(route, msg["status"])
            await send(msg)

        headers = dict(scope.get("headers") or [])
        if self._key is not None and path not in _PUBLIC and not self._authorized(headers.get(b"authorization")):
            err = ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <api_key>'",
                           type="authentication_error", code="invalid_api_key")
            return await error_response(err)(scope, receive, counted)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await error_response(protocol.invalid("content-length", "Content-Length is not a number"))(
                    scope, receive, counted)
            if n > self.ctx.settings.max_body_bytes:
                return await error_response(_too_large(n, self.ctx.settings.max_body_bytes))(scope, receive, counted)
        await self.app(scope, receive, counted)

    def _authorized(self, header: bytes | None) -> bool:
        assert self._key is not None
        if not header or not header[:7].lower() == b"bearer ":
            given = b""
        else:
            given = header[7:].strip()
        return hmac.compare_digest(given, self._key)


def _too_large(n: int | None, limit: int) -> ApiError:
    size = f"{n} bytes" if n is not None else f"over {limit} bytes"
    return ApiError(413, f"request body is {size}; the limit is {limit} bytes (max_body_bytes)", param="body",
                    code="request_too_large")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ------------------------------------------------------------------------------------------------ routes
def build_app(ctx: ServerContext) -> Any:
    """The ASGI app for one `ServerContext` (Starlette routes wrapped in `Gate`)."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "cbnb",
            "max_model_len": ctx.max_positions}]})

    async def health(request: Request) -> Response:
        state = ctx.engine.state
        ok = state in ("running", "created") and not ctx.closing
        return JSONResponse({"status": "ok" if ok else "unavailable", "engine": state}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        try:
            body = render(ctx.collector)
        except Exception as e:  # a scrape must not take the server down
            log.exception("metrics failed")
            return error_response(ApiError(500, f"metrics failed: {type(e).__name__}: {e}", type="server_error"))
        return Response(body, media_type=CONTENT_TYPE)

    async def completions(request: Request) -> Any:
        return await _guarded(ctx, request, "completion")

    async def chat(request: Request) -> Any:
        return await _guarded(ctx, request, "chat")

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    return Gate(app, ctx)


_ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}


async def _guarded(ctx: ServerContext, request: Request, kind: str) -> Any:
    try:
        return await _generate(ctx, request, kind)
    except ApiError as e:
        return error_response(e)
    except (ClientDisconnect, ClientGone):
        return Response(status_code=499)  # nobody reads it; counted as "client closed request"
    except Exception as e:  # never let one request's failure escape
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _generate(ctx: ServerContext, request: Request, kind: str) -> Any:
    s = ctx.settings
    obj = protocol.parse_json(await _read_body(request, s.max_body_bytes))
    g = protocol.parse_request(kind, obj, ctx.engine_args)
    if g.model is not None and g.model != ctx.model_name:
        raise ApiError(404, f"The model '{g.model}' does not exist; this server serves '{ctx.model_name}'",
                       param="model", code="model_not_found")
    _check_engine(ctx)
    if ctx.counters.snapshot()["in_flight"] >= s.max_concurrent_requests:
        raise ApiError(429, f"{s.max_concurrent_requests} requests are in flight (max_concurrent_requests): retry "
                       "later", type="rate_limit_error", code="rate_limit_exceeded", headers={"retry-after": "1"})
    peer = request.client
    slot = Slot(ctx.counters, peer.host if peer is not None else "unknown")  # clients: distinct addresses
    try:
        ids = await until_disconnect(request.receive, ctx.run_blocking(_encode, ctx.engine, g))
        max_new = _check_lengths(ctx, g, len(ids))
        handle = _submit(ctx, g, ids, max_new, f"{peer.host}:{peer.port}" if peer is not None else "unknown")
    except BaseException:
        slot.release()
        raise
    run = Generation(handle, g, slot, ctx.model_name, ctx.live, lambda: ctx.closing)
    if g.stream:
        return EventStream(run.stream, on_close=lambda gone: run.close())
    try:
        await until_disconnect(request.receive, run.collect())
    finally:
        run.close()
    if run.error is not None:
        raise run.error
    return JSONResponse(run.response())


def _check_engine(ctx: ServerContext) -> None:
    state = ctx.engine.state
    if ctx.closing or state not in ("running", "created"):
        why = "the server is stopping" if ctx.closing else f"the engine is {state}"
        err = getattr(ctx.engine, "error", None)
        if state == "dead" and err is not None:
            why += f" ({type(err).__name__}: {err})"
        raise ApiError(503, f"{why}: no request is accepted", type="server_error", code="engine_unavailable")


def _encode(engine: Any, g: GenerationRequest) -> list[int]:
    field = "prompt" if g.kind == "completion" else "messages"
    try:
        return engine.encode(g.prompt, chat=g.kind == "chat") if isinstance(g.prompt, str) else engine.encode(g.prompt)
    except Exception as e:  # tokenizer or chat-template errors are the request's problem
        raise protocol.invalid(field, f"cannot tokenize {field}: {e}") from None


def _check_lengths(ctx: ServerContext, g: GenerationRequest, n_prompt: int) -> int | None:
    """Prompt and generation limits; returns max_new_tokens for the engine."""
    s, ctx_len = ctx.settings, ctx.max_positions
    field = "prompt" if g.kind == "completion" else "messages"
    limit = s.max_prompt_tokens or (ctx_len - 1 if ctx_len else None)
    if limit is not None and n_prompt > limit:
        src = "max_prompt_tokens" if s.max_prompt_tokens else "the model's context minus one"
        raise protocol.invalid(field, f"{field} is {n_prompt} tokens; the limit is {limit} ({src})",
                               "context_length_exceeded")
    cap = s.max_tokens_limit
    if g.max_tokens is not None and cap is not None and g.max_tokens > cap:
        raise protocol.invalid("max_tokens", f"max_tokens must be in [1, {cap}] (max_tokens_limit); got {g.max_tokens}")
    room = ctx_len - n_prompt if ctx_len else None
    if g.max_tokens is not None and room is not None and g.max_tokens > room:
        raise protocol.invalid("max_tokens", f"this model's context is {ctx_len} tokens: {n_prompt} in the "
                               f"{field} leave room for at most {room} (max_tokens); got {g.max_tokens}",
                               "context_length_exceeded")
    if g.max_tokens is not None:
        return g.max_tokens
    bounds = [b for b in (cap, room) if b is not None]
    return min(bounds) if bounds else None


def _submit(ctx: ServerContext, g: GenerationRequest, ids: list[int], max_new: int | None, client: str) -> Any:
    from ..engine import EngineStoppedError

    rid = f"http-{next(_REQUEST_IDS)}"
    kw = dict(g.submit_kwargs)
    if "source" in ctx.engine_args:  # the engine records where a request came from (shown on the board)
        kw["source"] = f"http {client}" + (f" user={g.user}" if g.user else "")
    try:
        handle = ctx.engine.submit(ids, max_new_tokens=max_new, request_id=rid, **kw)
    except queue.Full as e:
        raise ApiError(429, f"the engine's queue is full: {e}", type="rate_limit_error", code="queue_full",
                       headers={"retry-after": "1"}) from None
    except EngineStoppedError as e:
        raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
    except ValueError as e:
        raise protocol.invalid("prompt" if g.kind == "completion" else "messages", str(e)) from None
    ctx.live[rid] = handle
    return handle
