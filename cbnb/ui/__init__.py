"""cbnb's notebook UI: live panels over a running `cbnb.Engine` (anywidget front-ends in `widgets/`).

::

    from cbnb.ui import Dashboard
    Dashboard(engine)          # Submit, Token stream, Request board, KV page map, Live plots, Config, Server, Runs

Each panel is also usable alone (`SubmitPanel(engine)`, `KVPageMapPanel(engine)`, ...). Names load lazily so that
`import cbnb.ui` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Dashboard": "cbnb.ui.dashboard",
    "SubmitPanel": "cbnb.ui.submit",
    "TokenStreamPanel": "cbnb.ui.stream",
    "RequestBoardPanel": "cbnb.ui.board",
    "KVPageMapPanel": "cbnb.ui.kvmap",
    "LivePlotsPanel": "cbnb.ui.plots",
    "ConfigPanel": "cbnb.ui.config_panel",
    "ServerPanel": "cbnb.ui.server_panel",
    "RunsPanel": "cbnb.ui.runs_panel",
    "Poller": "cbnb.ui.poller",
    "Panel": "cbnb.ui.base",
    "attach_headless_dashboard": "cbnb.ui.headless",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'cbnb.ui' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
