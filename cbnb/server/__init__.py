"""Serve a notebook's engine over an OpenAI-compatible HTTP API (needs the `serve` extra: uvicorn, starlette,
pydantic, prometheus_client).

::

    server = engine.serve(port=8000)               # 127.0.0.1 by default; other hosts need api_key
    from openai import OpenAI
    client = OpenAI(base_url=server.url, api_key="none")
    client.completions.create(model=server.model_name, prompt="Hello", max_tokens=16)

Modules: `settings` (where and what limits), `protocol` (request schemas, validation, OpenAI error JSON), `extras`
(vLLM's extra fields: structured-output spellings, template options), `app` (routes), `responses` (the Responses
API on the chat path), `generation` (a request's choices -> bodies and chunks), `tools` (tool calling), `sse`
(streaming and disconnects), `metrics` (Prometheus), `counters` (live figures), `lifecycle` (the uvicorn thread,
start/stop/drain, replacing a server on a port), `cli` (`cbnb serve MODEL`, also `python -m cbnb.server`).
`engine.serve(...)` calls `serve(engine, ...)` here. Importing this package needs none of the web stack; `serve()`
says what to install when it is missing.
"""

from __future__ import annotations

from .lifecycle import INSTALL_HINT, Server, serve, servers_for
from .settings import ServerSettings

__all__ = ["serve", "Server", "ServerSettings", "servers_for", "INSTALL_HINT"]
