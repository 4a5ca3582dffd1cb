"""`ServerPanel`: the engine's OpenAI-compatible servers, with copyable `curl` and `openai` snippets and live
counters (connected clients, requests in flight, requests per second).

It finds the servers through `cbnb.server.servers_for(engine)` at every poll, so a server started after the
dashboard appears on it, and one stopped disappears. The snippets never contain the API key itself: they read it
from the environment variable `CBNB_API_KEY` (a dashboard may be on a projector).
"""

from __future__ import annotations

import json
from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame

__all__ = ["ServerPanel", "snippets"]


def snippets(url: str, model: str, auth: bool) -> dict[str, str]:
    """A `curl` command and an `openai` Python snippet that send one chat request to `url` (the /v1 base)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    key_header = ' -H "Authorization: Bearer $CBNB_API_KEY"' if auth else ""
    curl = f"curl -s {url}/chat/completions -H 'Content-Type: application/json'{key_header} -d '{body}'"
    key = 'os.environ["CBNB_API_KEY"]' if auth else '"unused"'
    py = ("import os\n" if auth else "") + (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{url}", api_key={key})\n'
        f'r = client.chat.completions.create(model="{model}", max_tokens=32,\n'
        '                                   messages=[{"role": "user", "content": "Hello!"}])\n'
        "print(r.choices[0].message.content)")
    return {"curl": curl, "openai": py}


class ServerPanel(Panel):
    """The servers of one engine.

    Synced state: `servers`, one dict per running server: {url, host, model, auth, public (listens beyond this
    machine), snippets {curl, openai}, counters {clients, in_flight, connections, requests_per_s, requests_total,
    errors}}. Empty when the engine is not served (the panel then says how to start a server).
    """

    _esm = _assets.esm("server.js")
    servers = traitlets.List().tag(sync=True)

    def _values(self, frame: Frame) -> dict[str, Any]:
        from ..server.lifecycle import servers_for
        from ..server.settings import is_loopback

        out = []
        for s in servers_for(self.engine):
            c = s.counters()
            by_status = c.get("responses_by_status", {})
            auth = s.settings.api_key is not None
            out.append({
                "url": s.url, "host": s.host, "model": s.model_name, "auth": auth,
                "public": not is_loopback(s.host),
                "snippets": snippets(s.url, s.model_name, auth),
                "counters": {"clients": c.get("clients", 0), "in_flight": c.get("in_flight", 0),
                             "connections": c.get("connections"),
                             "requests_per_s": round(c.get("requests_per_s", 0), 2),
                             "requests_total": c.get("requests_total", 0),
                             "errors": sum(n for st, n in by_status.items() if int(st) >= 400)},
            })
        return {"servers": out}

    def _on_copied(self, msg: dict) -> None:
        which = msg.get("which")
        if which not in ("curl", "openai", "url"):
            self.show(f"copied: unknown snippet {which!r}", "error")
            return
        self.show(f"Copied the {which} {'snippet' if which != 'url' else ''}".rstrip() + " to the clipboard.", "ok")
