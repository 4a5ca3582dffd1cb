"""`Server`: uvicorn on its own thread and event loop, started and stopped from a notebook cell.

::

    server = serve(engine, port=8000)     # returns once the port accepts connections
    server.url                            # "http://127.0.0.1:8000/v1"
    server.counters()                     # requests, in flight, clients, requests/s, responses by status
    server.stop()                         # also when the engine stops

The kernel's own event loop is never used or blocked: the server thread runs a fresh asyncio loop. The socket is
bound in the calling thread, so a busy port fails in the cell with a clear error. Re-running the cell that serves
on a port stops the server this process already runs there, then binds again. The server stops by itself when its
engine is stopped (`engine.stop()`); while the engine is dead (repeated forward failures) it stays up and answers
503 with the engine's error, so clients see why.

This module imports no web stack until a server starts, so `servers_for()` (used by the dashboard) is always
importable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import socket
import threading
import time
import weakref
from typing import Any

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


class Server:
    """An OpenAI-compatible HTTP server over one engine (see `serve`).

    Attributes:
        engine: the served engine.
        settings: the `ServerSettings` in force.
        host, port: where it listens (`port` is the bound one, also when 0 was asked).
        url: the OpenAI base URL, e.g. "http://127.0.0.1:8000/v1" (give it to `openai.OpenAI(base_url=...)`).
    """

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.host = settings.host
        self.port = settings.port
        self._thread: threading.Thread | None = None
        self._uv: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: Any = None
        self._error: BaseException | None = None
        self._stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbnb-server-tokenize")

    # ------------------------------------------------------------------------------------------ properties
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
        return self._ctx.model_name if self._ctx is not None else (self.settings.model_name or "")

    def counters(self) -> dict[str, Any]:
        """Live figures: requests_total, in_flight, clients, connections, requests_per_s, responses_by_status,
        completion_tokens_total (see `ServerCounters`)."""
        snap = self._ctx.counters.snapshot() if self._ctx is not None else {}
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

        state = self.engine.state
        if state in ("stopped", "dead"):
            raise RuntimeError(f"the engine is {state}: start it (engine.start()) before serving it")
        if state == "created":
            self.engine.start()
        sock = self._bind()
        self.port = sock.getsockname()[1]
        self._ctx = ServerContext(self.engine, self.settings, self._run_blocking, self._connections)
        cfg = uvicorn.Config(build_app(self._ctx), log_config=None, access_log=False, lifespan="off", ws="none",
                             timeout_graceful_shutdown=max(1, int(round(self.settings.graceful_shutdown_s))),
                             limit_concurrency=max(1024, 4 * self.settings.max_concurrent_requests))
        self._uv = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._run, args=(sock,), name=f"cbnb-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._uv.should_exit = True
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

    async def _serve(self, sock: socket.socket) -> None:
        watch = asyncio.ensure_future(self._watch_engine())
        try:
            await self._uv.serve(sockets=[sock])
        finally:
            watch.cancel()

    async def _watch_engine(self) -> None:
        """Stop with the engine: `engine.stop()` (state "stopped") ends the server too."""
        engine_ref = weakref.ref(self.engine)
        while not self._uv.should_exit:
            eng = engine_ref()
            if eng is None or eng.state == "stopped":
                self._begin_shutdown()
                return
            await asyncio.sleep(_WATCH_S)

    def _begin_shutdown(self) -> None:
        # On the server's loop: refuse new requests, cancel live ones (their streams end), then let uvicorn close.
        if self._ctx is not None:
            self._ctx.close()
        self._uv.should_exit = True

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
          allow_unauthenticated: bool = False, model_name: str | None = None, max_body_bytes: int = 1 << 20,
          max_prompt_tokens: int | None = None, max_tokens_limit: int | None = None,
          max_concurrent_requests: int = 256, graceful_shutdown_s: float = 3.0) -> Server:
    """Serve `engine` over an OpenAI-compatible HTTP API from a background thread; returns the running `Server`.

    Args:
        engine: a `cbnb.Engine` (started if it was never started).
        host, port, api_key, allow_unauthenticated, model_name, max_body_bytes, max_prompt_tokens,
        max_tokens_limit, max_concurrent_requests, graceful_shutdown_s: see `ServerSettings`.

    A server that this process already runs on `port` is stopped first (re-running a cell replaces it).

    Raises:
        ImportError: without the web stack: ``pip install 'cbnb[serve]'``.
        ValueError: bad settings, or a non-loopback `host` without `api_key` / `allow_unauthenticated`.
        OSError: when another program holds the port.
    """
    _require_stack()
    settings = ServerSettings(host=host, port=port, api_key=api_key, allow_unauthenticated=allow_unauthenticated,
                              model_name=model_name, max_body_bytes=max_body_bytes,
                              max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                              max_concurrent_requests=max_concurrent_requests,
                              graceful_shutdown_s=graceful_shutdown_s)
    if port:
        with _LOCK:
            old = _SERVERS.get(port)
        if old is not None:
            log.info("replacing the cbnb server at %s", old.url)
            old.stop()
    return Server(engine, settings).start()
