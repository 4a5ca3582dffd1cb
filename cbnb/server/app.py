"""The ASGI application (Starlette): OpenAI-compatible routes over one engine.

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`,
`POST /v1/responses` (`cbnb.server.responses`), `POST /tokenize`, `POST /detokenize` (vLLM's shapes), `GET /health`,
`GET|POST /ping` (= /health, vLLM's), `GET /version` ({"version": cbnb's}), `GET /metrics`. A request's `model` may be the
served name or one of its aliases (`model_aliases_of`: e.g. the Hugging Face id of a bundled model).
Every route but `/health`, `/ping` and `/version` needs the API key when one is set. Each generation request is an ordinary engine request
(id ``http-N``, source ``"http <host>:<port>"`` of the client, plus ``user=`` when the body names one): the
dashboard's board and the engine's stats show it like any other. Its life:

    body (<= max_body_bytes, else 413) -> JSON object (400) -> schema (400 naming the field) -> model (404)
    -> engine up (503) -> a concurrency slot (429) -> tokenize each prompt on the server's worker thread ->
    prompt and max_tokens limits (400) -> engine.submit, one engine request per (prompt, choice) (429 when its
    queue is full; a failure cancels those already queued) -> stream or collect the deltas, watching for the
    client's disconnect (-> the requests are cancelled, their blocks freed)

With `n` > 1, a prompt's first choice is submitted alone and its siblings once it has produced its first token
(`PrimedHandle`): its prompt blocks are then in the prefix cache, so the prompt is computed once, not n times.

No failure inside one request reaches the engine or another request: each handler turns any exception into an
error response (500 for the unexpected, logged).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import queue
import sys
import time
import uuid
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import protocol, responses
from .counters import ServerCounters
from .metrics import CONTENT_TYPE, EngineCollector, render
from .protocol import ApiError, GenerationRequest
from .settings import ServerSettings
from .generation import Generation, PrimedHandle, Slot, TokenText
from .sse import ClientGone, EventStream, until_disconnect
from .tools import render as render_tools
from ..engine.structured import warm

__all__ = ["ServerContext", "build_app"]

log = logging.getLogger("cbnb.server")

_REQUEST_IDS = itertools.count(1)  # process-wide: two servers on one engine never reuse an id
_PUBLIC = {"/health", "/ping", "/version"}


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
        from ..engine.engine_like import submit_keywords

        self.engine = engine
        self.settings = settings
        self.run_blocking = run_blocking
        self.counters = ServerCounters()
        self.collector = EngineCollector(engine, self.counters, connections)
        self.model_name = settings.model_name or model_name_of(engine)
        self.aliases = [a for a in dict.fromkeys([*settings.model_aliases, *model_aliases_of(engine)])
                        if a != self.model_name]
        self.token_text = TokenText(getattr(engine, "tokenizer", None))
        self.engine_args = submit_keywords(engine)  # what the engine honours (`cbnb.engine.engine_like`)
        self.live: dict[str, Any] = {}  # request id -> handle, for the requests this server submitted
        self.store = responses.ResponseStore()  # recent /v1/responses conversations (previous_response_id)
        self.closing = False
        self.created = int(time.time())

    def close(self) -> None:
        """Refuse new requests and cancel the live ones (called on the server's loop when it stops)."""
        self.closing = True
        for handle in list(self.live.values()):
            handle.cancel()

    @property
    def max_positions(self) -> int | None:
        """Prompt plus generated tokens at most: the model's context, or `max_model_len` when it is set."""
        model = getattr(self.engine, "max_positions", None)
        cap = self.settings.max_model_len
        return model if cap is None else cap if model is None else min(model, cap)

    @property
    def model_ids(self) -> list[str]:
        """The served name, then its aliases: every `model` a request may name."""
        return [self.model_name, *self.aliases]

    def check_model(self, model: str | None) -> str:
        """The model id to echo in a response: `model` when it is the served name or an alias, the served name
        when None.

        Raises:
            ApiError: 404 "model_not_found" for any other name.
        """
        if model is None:
            return self.model_name
        if model in self.model_ids:
            return model
        listed = " or ".join(f"'{m}'" for m in self.model_ids)
        raise ApiError(404, f"The model '{model}' does not exist; this server serves {listed}", param="model",
                       code="model_not_found")

    def card(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.created, "owned_by": "cbnb",
                "root": self.model_name, "max_model_len": self.max_positions}


# Bundled models (cbnb.load_model names) -> the Hugging Face id of the model they hold, accepted as an alias.
HF_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}


def model_aliases_of(engine: Any) -> list[str]:
    """Other names of the served model: its folder or hub name (last part), the full hub id when it was loaded
    from the hub ("owner/name"), and the Hugging Face id of a bundled model (`HF_IDS`)."""
    import os

    cfg = getattr(getattr(engine, "model", None), "config", None)
    path = str(getattr(cfg, "_name_or_path", "") or "").rstrip("/")
    if not path:
        return []
    last = path.rsplit("/", 1)[-1]
    out = [last]
    if path.count("/") == 1 and not os.path.exists(path):  # a hub id, not a local folder
        out.append(path)
    if last in HF_IDS:
        out.append(HF_IDS[last])
    return list(dict.fromkeys(out))


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
        route = _route_of(path)
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
        return JSONResponse({"object": "list", "data": [ctx.card(m) for m in ctx.model_ids]})

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in ctx.model_ids:
            return error_response(ApiError(404, f"The model '{name}' does not exist; this server serves "
                                           + " or ".join(f"'{m}'" for m in ctx.model_ids), param="model",
                                           code="model_not_found"))
        return JSONResponse(ctx.card(name))

    async def tokenize(request: Request) -> Any:
        return await _guarded_call(lambda: _tokenize(ctx, request))

    async def detokenize(request: Request) -> Any:
        return await _guarded_call(lambda: _detokenize(ctx, request))

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

    async def create_response(request: Request) -> Any:
        return await _guarded(ctx, request, "responses")

    async def version(request: Request) -> Response:
        # the package is imported before any of its modules (no import of it here: tests/test_imports.py)
        return JSONResponse({"version": sys.modules["cbnb"].__version__, "server": "cbnb"})

    async def ping(request: Request) -> Response:  # vLLM's (SageMaker's) liveness route: /health's answer
        return await health(request)

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    return Gate(app, ctx)


_ROUTES = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/health", "/ping", "/version",
           "/metrics", "/tokenize", "/detokenize"}


def _route_of(path: str) -> str:
    if path in _ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


async def _guarded_call(work: Callable[[], Any]) -> Any:
    try:
        return await work()
    except ApiError as e:
        return error_response(e)
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception as e:  # never let one request's failure escape
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))


async def _tokenizer_request(ctx: ServerContext, request: Request, parse: Any, verb: str, param: str) -> tuple:
    """The parsed body of a /tokenize or /detokenize request and the engine's tokenizer (a 400 naming `param`
    when the engine has none)."""
    body = parse(protocol.parse_json(await _read_body(request, ctx.settings.max_body_bytes)))
    ctx.check_model(body.model)
    tok = getattr(ctx.engine, "tokenizer", None)
    if tok is None:
        raise ApiError(400, f"this engine has no tokenizer: nothing to {verb} with", param=param,
                       code="no_tokenizer")
    return body, tok


async def _tokenize(ctx: ServerContext, request: Request) -> Response:
    """vLLM's `POST /tokenize`: {model?, prompt, add_special_tokens=true} or {model?, messages,
    add_generation_prompt=true, add_special_tokens=false} -> {count, max_model_len, tokens, token_strs=null}."""
    body, tok = await _tokenizer_request(ctx, request, protocol.parse_tokenize, "tokenize", "prompt")

    def work() -> list[int]:
        field = "prompt" if body.prompt is not None else "messages"
        try:
            if body.prompt is not None:
                return list(tok(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"])
            msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.content or ""}
                    for m in body.messages]
            gen = body.add_generation_prompt is not False
            if body.add_special_tokens:
                text = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
                return list(tok(text, add_special_tokens=True)["input_ids"])
            out = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        except Exception as e:  # the tokenizer's or the template's error is the request's problem
            raise protocol.invalid(field, f"cannot tokenize {field}: {e}") from None

    ids = await ctx.run_blocking(work)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_positions, "tokens": ids, "token_strs": None})


async def _detokenize(ctx: ServerContext, request: Request) -> Response:
    """vLLM's `POST /detokenize`: {model?, tokens} -> {prompt} (special tokens kept in the text)."""
    body, tok = await _tokenizer_request(ctx, request, protocol.parse_detokenize, "detokenize", "tokens")
    vocab = getattr(ctx.engine, "vocab_size", None)
    bad = next((i for i in body.tokens if i < 0 or (vocab is not None and i >= vocab)), None)
    if bad is not None:
        raise protocol.invalid("tokens", f"tokens must be token ids in [0, {vocab - 1 if vocab else '...'}]; "
                               f"got {bad}")
    text = await ctx.run_blocking(lambda: tok.decode(body.tokens))
    return JSONResponse({"prompt": text})


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
    obj = protocol.parse_json(await _read_body(request, ctx.settings.max_body_bytes))
    if kind == "responses":
        return await _responses(ctx, request, obj)
    g = protocol.parse_request(kind, obj, ctx.engine_args)
    run = await _start(ctx, request, g)
    if g.stream:
        return EventStream(run.stream, on_close=lambda gone: run.close())
    await _collect(request, run)
    return JSONResponse(run.response())


async def _collect(request: Request, run: Any) -> None:
    """Wait for a non-streamed run's whole answer (cancelled when the client hangs up), then free it; its error,
    if it failed, is raised."""
    try:
        await until_disconnect(request.receive, run.collect())
    finally:
        run.close()
    if run.error is not None:
        raise run.error


async def _responses(ctx: ServerContext, request: Request, obj: dict[str, Any]) -> Any:
    """`POST /v1/responses` on the chat path (`cbnb.server.responses`)."""
    chat, history = responses.to_chat(obj, ctx.store)
    g = protocol.parse_request("chat", chat, ctx.engine_args)
    run = await _start(ctx, request, g)
    rid = f"resp_{uuid.uuid4().hex}"
    keep = obj.get("store") is not False
    if g.stream:
        async def produce(emit: Callable[[bytes], Any]) -> None:
            ev = responses.ResponseEvents(obj, rid, run.model_name, emit)
            await ev.start()
            c, finish = run.choices[0], None
            async for chunk in run.chunks(c):
                finish = await ev.chunk(chunk) or finish
            if c.error is not None:
                await ev.fail(c.error)
                return
            await ev.end(finish, run.usage())
            if keep:
                ctx.store.put(rid, history + [ev.stored])

        return EventStream(produce, on_close=lambda gone: run.close())
    await _collect(request, run)
    body, stored = responses.response_body(run.response(), obj, rid)
    if keep:
        ctx.store.put(rid, history + [stored])
    return JSONResponse(body)


async def _start(ctx: ServerContext, request: Request, g: GenerationRequest) -> Generation:
    """Check a parsed request against the server's limits, submit its engine requests; returns its `Generation`."""
    s = ctx.settings
    model = ctx.check_model(g.model)
    _check_engine(ctx)
    if ctx.counters.snapshot()["in_flight"] >= s.max_concurrent_requests:
        raise ApiError(429, f"{s.max_concurrent_requests} requests are in flight (max_concurrent_requests): retry "
                       "later", type="rate_limit_error", code="rate_limit_exceeded", headers={"retry-after": "1"})
    _check_stop_token_ids(ctx, g)
    peer = request.client
    slot = Slot(ctx.counters, peer.host if peer is not None else "unknown")  # clients: distinct addresses
    handles: list[Any] = []
    try:
        prompts = await until_disconnect(request.receive,
                                         ctx.run_blocking(_encode_all, ctx.engine, g, ctx.max_positions))
        limits = [_check_lengths(ctx, g, len(ids), i if len(prompts) > 1 else None) for i, ids in enumerate(prompts)]
        if g.max_tokens == 0:  # echo alone: the engine generates one token, which the answer leaves out
            limits = [1] * len(limits)
        client = f"{peer.host}:{peer.port}" if peer is not None else "unknown"
        grid: list[list[Any]] = []
        for ids, max_new in zip(prompts, limits):
            first = _submit(ctx, g, ids, max_new, client, 0)
            handles.append(first)
            grid.append([first])
        rows = [row for row, ids in zip(grid, prompts) if g.n > 1 and _shares_prefixes(ctx.engine, len(ids))]
        if rows:
            # A prompt's siblings are submitted once its first choice has computed it: its full blocks are then in
            # the prefix cache, and each sibling computes only the prompt's last, partial block.
            for row in rows:
                row[0] = PrimedHandle(row[0])
            await until_disconnect(request.receive, asyncio.gather(*(row[0].prime() for row in rows)))
        for row, ids, max_new in zip(grid, prompts, limits):
            for j in range(1, g.n):
                h = _submit(ctx, g, ids, max_new, client, j)
                handles.append(h)
                row.append(h)
    except BaseException as e:
        for h in handles:  # a batch is all or nothing: the requests already queued are cancelled
            h.cancel()
            ctx.live.pop(h.request_id, None)
        slot.release()
        if isinstance(e, ApiError) and handles:
            # ... and have left the engine's queue when the error is answered (a cancel takes effect at the loop's
            # next turn), so a client that retries at once with a smaller batch finds their room free.
            await ctx.run_blocking(_settle, handles, _SETTLE_S)
        raise
    return Generation([h for row in grid for h in row], g, slot, model, ctx.live, lambda: ctx.closing, ctx.token_text)


_SETTLE_S = 5.0  # bound on waiting for a refused batch's cancelled choices (about one engine step)


def _settle(handles: list[Any], timeout: float) -> None:
    """Wait until the cancelled `handles` have ended (at most `timeout` seconds in all; on a worker thread)."""
    deadline = time.monotonic() + timeout
    for h in handles:
        try:
            h.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return


def _check_engine(ctx: ServerContext) -> None:
    state = ctx.engine.state
    if ctx.closing or state not in ("running", "created"):
        why = "the server is stopping" if ctx.closing else f"the engine is {state}"
        err = getattr(ctx.engine, "error", None)
        if state == "dead" and err is not None:
            why += f" ({type(err).__name__}: {err})"
        raise ApiError(503, f"{why}: no request is accepted", type="server_error", code="engine_unavailable")


def _encode_all(engine: Any, g: GenerationRequest, ctx_len: int | None) -> list[list[int]]:
    """Token ids of each prompt (on the worker thread; there too, the first grammar's one-time tokenizer build);
    `ctx_len`: the served context (`ServerContext.max_positions`), for ``truncate_prompt_tokens=-1``."""
    field = "prompt" if g.kind == "completion" else "messages"
    if "response_format" in g.submit_kwargs or "json_schema" in g.submit_kwargs:
        try:
            warm(getattr(engine, "tokenizer", None), engine.vocab_size, getattr(engine, "default_eos", ()))
        except ValueError as e:
            raise protocol.invalid(g.structured_field or "tools", str(e)) from None
    out = []
    tok = getattr(engine, "tokenizer", None)
    for i, prompt in enumerate(g.prompts):
        where = f"{field}[{i}]" if len(g.prompts) > 1 else field
        try:
            if g.kind == "chat" and tok is not None:  # the template (tools and vLLM's template fields) applied
                ids = engine.encode(render_tools(tok, prompt, g.tools, g.template))
            elif isinstance(prompt, str) and tok is not None and not g.add_special_tokens:
                ids = engine.encode(list(tok(prompt, add_special_tokens=False)["input_ids"]))
            else:
                ids = engine.encode(prompt, chat=g.kind == "chat") if isinstance(prompt, str) else engine.encode(prompt)
        except Exception as e:  # tokenizer or chat-template errors are the request's problem
            raise protocol.invalid(where, f"cannot tokenize {where}: {e}") from None
        if g.truncate is not None:  # vLLM's truncate_prompt_tokens: the last k tokens (-1: the context)
            keep = g.truncate if g.truncate >= 0 else (ctx_len or len(ids))
            if keep == 0:
                raise protocol.invalid("truncate_prompt_tokens", "truncate_prompt_tokens=0 leaves no prompt; give "
                                       "k >= 1 (the prompt's last k tokens) or -1 (the model's context)")
            ids = ids[-keep:]
        out.append(ids)
    return out


def _shares_prefixes(engine: Any, n_prompt: int) -> bool:
    """Whether a prompt of `n_prompt` tokens leaves full blocks in the engine's prefix cache for later requests."""
    cfg = getattr(engine, "config", None)
    page = getattr(cfg, "page_size", None)
    return bool(getattr(cfg, "allow_block_sharing", False)) and page is not None and n_prompt >= page


def _check_stop_token_ids(ctx: ServerContext, g: GenerationRequest) -> None:
    vocab = getattr(ctx.engine, "vocab_size", None)
    bad = [i for i in g.stop_token_ids or () if vocab is not None and i >= vocab]
    if bad:
        raise protocol.invalid("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab - 1}]; got {bad[0]}")


def _eos_with(engine: Any, extra: list[int]) -> list[int]:
    """The engine's EOS ids for a request (the generation config's, else the model's) plus `extra`."""
    base = getattr(getattr(engine, "generation_defaults", None), "eos_token_id", None)
    if base is None:
        base = getattr(engine, "default_eos", None)
    ids = [base] if isinstance(base, int) else list(base or ())
    return sorted(set(ids) | set(extra))


def _check_lengths(ctx: ServerContext, g: GenerationRequest, n_prompt: int, index: int | None = None) -> int | None:
    """Prompt and generation limits; returns max_new_tokens for the engine."""
    s, ctx_len = ctx.settings, ctx.max_positions
    field = "prompt" if g.kind == "completion" else "messages"
    if index is not None:
        field = f"{field}[{index}]"
    limit = s.max_prompt_tokens or (ctx_len - 1 if ctx_len else None)
    if limit is not None and n_prompt > limit:
        src = "max_prompt_tokens" if s.max_prompt_tokens else (
            "max_model_len minus one" if s.max_model_len else "the model's context minus one")
        raise protocol.invalid(field, f"{field} is {n_prompt} tokens; the limit is {limit} ({src})",
                               "context_length_exceeded")
    cap = s.max_tokens_limit
    if g.max_tokens is not None and cap is not None and g.max_tokens > cap:
        raise protocol.invalid("max_tokens", f"max_tokens must be in [1, {cap}] (max_tokens_limit); got {g.max_tokens}")
    room = ctx_len - n_prompt if ctx_len else None
    if g.max_tokens is not None and room is not None and g.max_tokens > room:
        what = "max_model_len" if s.max_model_len == ctx_len else "this model's context"
        raise protocol.invalid("max_tokens", f"{what} is {ctx_len} tokens: {n_prompt} in the "
                               f"{field} leave room for at most {room} (max_tokens); got {g.max_tokens}",
                               "context_length_exceeded")
    if g.max_tokens is not None:
        return g.max_tokens
    bounds = [b for b in (cap, room) if b is not None]
    return min(bounds) if bounds else None


# engine.submit keyword -> the request field it came from (for the `param` of an error the engine raises)
_FIELD_OF = {"min_new_tokens": "min_tokens", "eos_token_id": "stop_token_ids", "logit_bias": "logit_bias",
             "repetition_penalty": "repetition_penalty", "min_p": "min_p", "top_k": "top_k", "top_p": "top_p",
             "temperature": "temperature", "seed": "seed", "stop": "stop", "logprobs": "logprobs",
             "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
             "prompt_logprobs": "echo", "response_format": "response_format", "json_schema": "tools"}


def _submit(ctx: ServerContext, g: GenerationRequest, ids: list[int], max_new: int | None, client: str,
            choice: int = 0) -> Any:
    from ..engine.inbox import EngineStoppedError

    rid = f"http-{next(_REQUEST_IDS)}"
    kw = dict(g.submit_kwargs)
    if "seed" in kw:
        kw["seed"] = g.seed_of(choice)  # each choice its own stream
    if g.stop_token_ids:
        kw["eos_token_id"] = _eos_with(ctx.engine, g.stop_token_ids)
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
        msg = str(e)
        param = next((f for arg, f in _FIELD_OF.items() if msg.startswith(arg) and arg in kw), None)
        if param == "response_format" and g.structured_field not in (None, "response_format"):
            param = g.structured_field  # a vLLM spelling, mapped to the engine's response_format
        if param == "tools" and msg.startswith("json_schema"):  # the forced call's grammar, from the tools
            msg = "a function's parameters (tools[].function.parameters)" + msg[len("json_schema"):]
        raise protocol.invalid(param or ("prompt" if g.kind == "completion" else "messages"), msg) from None
    ctx.live[rid] = handle
    return handle
