"""`Server`: uvicorn on its own thread and event loop, started and stopped from a notebook cell.

::

    server = engine.serve(port=8000)      # (= serve(engine, port=8000)) returns once the port accepts connections
    server.url                            # "http://127.0.0.1:8000/v1"
    server.counters()                     # requests, in flight, clients, requests/s, responses by status
    server.stop()                         # engine.stop() stops it too

The kernel's own event loop is never used or blocked: the server thread runs a fresh asyncio loop. The socket is
bound in the calling thread, so a busy port fails in the cell with a clear error. Re-running the cell that serves
on a port stops the server this process already runs there, then binds again.

Lifetime: a running server holds its engine, so a served engine lives (and serves) until `server.stop()` or
`engine.stop()`, even when no notebook name refers to it any more; a stopped server lets go of it (the engine's
finalizer can then free it). `engine.stop()` stops the engine's servers itself; a watcher on the server's loop also
ends it within 0.2 s of the engine's loop ending any other way. While the engine is dead (repeated forward
failures) the server stays up and answers 503 with the engine's error, so clients see why. At interpreter exit
every server is stopped (in-flight requests cancelled, ports closed) before the threads are frozen.

This module imports no web stack until a server starts, so `servers_for()` (used by the dashboard) is always
importable.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import errno
import logging
import socket
import threading
import time
import weakref
from typing import Any, Sequence

from .settings import ServerSettings

__all__ = ["Server", "serve", "servers_for", "INSTALL_HINT"]

log = logging.getLogger("cbnb.server")

INSTALL_HINT = "pip install 'cbnb[serve]'"
_SERVERS: dict[int, "Server"] = {}  # port -> the running server of this process on that port
_LOCK = threading.Lock()
_WATCH_S = 0.2  # how often the server looks at its engine's state


def _require_stack() -> None:
    missing = []
    for mod in ("uvicorn", "starlette", "pydantic", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ImportError(f"serving needs {', '.join(missing)}: {INSTALL_HINT}")


def servers_for(engine: Any) -> list["Server"]:
    """The running servers of this process that serve `engine` (oldest first)."""
    with _LOCK:
        return [s for s in _SERVERS.values() if s.engine is engine and s.running]


@atexit.register
def _stop_all() -> None:
    # At interpreter exit, before the threads are frozen: cancel what is in flight and close every port, so no
    # server thread is left half-way through a response (engines stop through their own finalizers).
    with _LOCK:
        servers = list(_SERVERS.values())
    for s in servers:
        try:
            s.stop(timeout=5.0)
        except Exception:  # exit goes on for the others
            log.exception("stopping the cbnb server on port %s at exit", s.port)


class Server:
    """An OpenAI-compatible HTTP server over one engine (see `serve`).

    Attributes:
        engine: the served engine.
        settings: the `ServerSettings` in force.
        host, port: where it listens (`port` is the bound one, also when 0 was asked).
        url: the OpenAI base URL, e.g. "http://127.0.0.1:8000/v1" (give it to `openai.OpenAI(base_url=...)`).
    """

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self._engine: Any = engine  # strong while it serves; a stopped server keeps only `_engine_ref`
        self._engine_ref = weakref.ref(engine)
        self.settings = settings
        self.host = settings.host
        self.port = settings.port
        self._model_name = settings.model_name or ""
        self._thread: threading.Thread | None = None
        self._uv: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: Any = None
        self._counters: Any = None
        self._error: BaseException | None = None
        self._stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbnb-server-tokenize")

    # ------------------------------------------------------------------------------------------ properties
    @property
    def engine(self) -> Any:
        """The served engine; None once the server stopped and nothing else keeps the engine alive."""
        return self._engine if self._engine is not None else self._engine_ref()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
        return f"http://{host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return self._model_name

    def counters(self) -> dict[str, Any]:
        """Live figures: requests_total, in_flight, clients, connections, requests_per_s, responses_by_status,
        completion_tokens_total (see `ServerCounters`); the last ones after the server stopped."""
        counters = self._counters
        snap = counters.snapshot() if counters is not None else {}
        snap["connections"] = self._connections()
        snap["running"] = self.running
        return snap

    def _connections(self) -> int | None:
        state = getattr(self._uv, "server_state", None)
        conns = getattr(state, "connections", None)
        return len(conns) if conns is not None else None

    # ------------------------------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 30.0) -> "Server":
        """Bind the port and start serving; returns once connections are accepted.

        Raises:
            ImportError: without the web stack (`pip install 'cbnb[serve]'`).
            OSError: when the port is taken by another program.
            RuntimeError: when the engine is stopped or dead, or the server fails to start.
        """
        _require_stack()
        import uvicorn

        from .app import ServerContext, build_app

        engine = self._engine
        if engine is None:
            raise RuntimeError("a stopped server does not start again: serve the engine anew (engine.serve())")
        state = engine.state
        if state in ("stopped", "dead"):
            raise RuntimeError(f"the engine is {state}: start it (engine.start()) before serving it")
        if state == "created":
            engine.start()
        sock = self._bind()
        self.port = sock.getsockname()[1]
        self._ctx = ctx = ServerContext(engine, self.settings, self._run_blocking, self._connections)
        self._counters, self._model_name = ctx.counters, ctx.model_name
        cfg = uvicorn.Config(build_app(ctx), log_config=None, access_log=False, lifespan="off", ws="none",
                             timeout_graceful_shutdown=max(1, int(round(self.settings.graceful_shutdown_s))),
                             limit_concurrency=max(1024, 4 * self.settings.max_concurrent_requests))
        self._uv = uv = uvicorn.Server(cfg)
        self._thread = thread = threading.Thread(target=self._run, args=(sock,), name=f"cbnb-server-{self.port}",
                                                 daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                uv.should_exit = True
                raise RuntimeError(f"the server on port {self.port} did not start: {self._error!r}")
            time.sleep(0.01)
        with _LOCK:
            _SERVERS[self.port] = self
        return self

    def _bind(self) -> socket.socket:
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind at once after a re-run (TIME_WAIT)
        try:
            sock.bind((self.host.strip("[]"), self.port))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"port {self.port} on {self.host} is in use by another program: stop it, "
                              "or pass another port (port=0 picks a free one)") from None
            raise
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock

    async def _run_blocking(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as e:  # surfaced by start() / repr
            self._error = e
            log.exception("cbnb server on port %s failed", self.port)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                sock.close()
                self._pool.shutdown(wait=False)
                with _LOCK:
                    if _SERVERS.get(self.port) is self:
                        del _SERVERS[self.port]
                # A stopped server no longer keeps its engine alive: the app, the uvicorn server and the routes'
                # context all hold it, so drop them (the counters stay readable).
                self._engine = self._ctx = self._uv = self._loop = None

    async def _serve(self, sock: socket.socket) -> None:
        watch = asyncio.ensure_future(self._watch_engine())
        try:
            await self._uv.serve(sockets=[sock])
        finally:
            watch.cancel()

    async def _watch_engine(self) -> None:
        """Stop with the engine, however it was stopped (`engine.stop()` stops its servers directly; this also
        covers a loop ended another way, e.g. by the engine's finalizer at interpreter exit)."""
        uv, engine_ref = self._uv, self._engine_ref
        while not uv.should_exit:
            eng = engine_ref()
            if eng is None or eng.state == "stopped":
                self._begin_shutdown()
                return
            del eng
            await asyncio.sleep(_WATCH_S)

    def _begin_shutdown(self) -> None:
        # On the server's loop: refuse new requests, cancel live ones (their streams end), then let uvicorn close.
        ctx, uv = self._ctx, self._uv
        if ctx is not None:
            ctx.close()
        if uv is not None:
            uv.should_exit = True

    def drain(self, timeout: float = 30.0, give_up: Any = None) -> int:
        """Refuse new requests (503; `/health` answers 503 too) and wait until the requests in flight have ended,
        at most `timeout` seconds or until ``give_up()`` is true. Returns how many are still in flight (0: all
        ended). `stop()` then closes the port (and cancels what is left)."""
        ctx, loop = self._ctx, self._loop
        if ctx is None or loop is None or loop.is_closed():
            return 0

        def close_door() -> None:
            ctx.closing = True  # on the server's loop, like every other change to the routes' context

        try:
            loop.call_soon_threadsafe(close_door)
        except RuntimeError:  # the loop closed meanwhile
            return 0
        deadline = time.monotonic() + timeout
        while True:
            left = ctx.counters.snapshot()["in_flight"]
            if not left or time.monotonic() > deadline or (give_up is not None and give_up()):
                return left
            time.sleep(0.05)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop serving: new requests are refused, live ones are cancelled (their blocks freed), the port is
        released. Idempotent."""
        with _LOCK:
            if _SERVERS.get(self.port) is self:
                del _SERVERS[self.port]
        thread, loop = self._thread, self._loop
        if thread is None or not thread.is_alive():
            return
        self._stopping = True
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._begin_shutdown)
            except RuntimeError:  # the loop closed meanwhile
                pass
        thread.join(timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Server({self.url}, {state}, model={self.model_name!r})"


def serve(engine: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, *,
          allow_unauthenticated: bool = False, model_name: str | None = None,
          model_aliases: Sequence[str] = (), max_body_bytes: int = 1 << 20,
          max_prompt_tokens: int | None = None, max_tokens_limit: int | None = None,
          max_model_len: int | None = None, max_concurrent_requests: int = 256,
          graceful_shutdown_s: float = 3.0) -> Server:
    """Serve `engine` over an OpenAI-compatible HTTP API from a background thread; returns the running `Server`.

    Args:
        engine: a `cbnb.Engine` (started if it was never started).
        host, port, api_key, allow_unauthenticated, model_name, model_aliases, max_body_bytes, max_prompt_tokens,
        max_tokens_limit, max_model_len, max_concurrent_requests, graceful_shutdown_s: see `ServerSettings`.

    A server that this process already runs on `port` is stopped first (re-running a cell replaces it). The
    running server holds `engine` (see the module docstring for the lifetime rule). `engine.serve(...)` calls this.

    Raises:
        ImportError: without the web stack: ``pip install 'cbnb[serve]'``.
        ValueError: bad settings, a non-loopback `host` without `api_key` / `allow_unauthenticated`, or a
            `max_model_len` above the model's context.
        OSError: when another program holds the port.
    """
    _require_stack()
    settings = ServerSettings(host=host, port=port, api_key=api_key, allow_unauthenticated=allow_unauthenticated,
                              model_name=model_name, model_aliases=tuple(model_aliases),
                              max_body_bytes=max_body_bytes,
                              max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                              max_model_len=max_model_len, max_concurrent_requests=max_concurrent_requests,
                              graceful_shutdown_s=graceful_shutdown_s)
    ctx_len = getattr(engine, "max_positions", None)
    if max_model_len is not None and ctx_len is not None and max_model_len > ctx_len:
        raise ValueError(f"max_model_len ({max_model_len}) is greater than the model's context ({ctx_len} tokens)")
    if port:
        with _LOCK:
            old = _SERVERS.get(port)
        if old is not None:
            log.info("replacing the cbnb server at %s", old.url)
            old.stop()
    return Server(engine, settings).start()
