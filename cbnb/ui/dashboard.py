"""`Dashboard`: all panels over one engine, fed by one poller thread."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from .board import RequestBoardPanel
from .config_panel import ConfigPanel
from .kvmap import KVPageMapPanel
from .plots import LivePlotsPanel
from .poller import Poller
from .runs_panel import RunsPanel
from .server_panel import ServerPanel
from .stream import TokenStreamPanel
from .submit import SubmitPanel

__all__ = ["Dashboard"]


class Dashboard(widgets.VBox):
    """The engine's dashboard: Submit, Token stream, Request board, KV page map, Live plots, Config, Server and Runs.

    Args:
        engine: a `cbnb.Engine` (started or not; submitting starts it).
        max_hz: update rate cap of the shared poller, in (0, 10].
        always_snapshot: take KV snapshots even when the page map is off screen (headless benchmarks).
        start: start the poller now.

    Attributes:
        submit, stream, board, kvmap, plots, config, server, runs: the panels (each also usable alone).
        poller: the `Poller` feeding them.

    Display it as the last expression of a cell. `close()` stops the poller and closes the widgets.
    """

    def __init__(self, engine: Any, *, max_hz: float = 10.0, always_snapshot: bool = False,
                 start: bool = True) -> None:
        self.engine = engine
        self.poller = Poller(engine, max_hz=max_hz)
        kw = {"poller": self.poller}
        self.submit = SubmitPanel(engine, **kw)
        self.stream = TokenStreamPanel(engine, **kw)
        self.board = RequestBoardPanel(engine, **kw)
        self.kvmap = KVPageMapPanel(engine, always_snapshot=always_snapshot, **kw)
        self.plots = LivePlotsPanel(engine, **kw)
        self.config = ConfigPanel(engine, **kw)
        self.server = ServerPanel(engine, **kw)
        self.runs = RunsPanel(engine, **kw)
        for p in (self.submit, self.stream, self.kvmap, self.config):
            p.layout.width, p.layout.min_width = "50%", "360px"
        row1 = widgets.HBox([self.submit, self.stream], layout=widgets.Layout(width="100%", flex_flow="row wrap"))
        row2 = widgets.HBox([self.kvmap, self.config], layout=widgets.Layout(width="100%", flex_flow="row wrap"))
        self._rows = [row1, row2]
        super().__init__([row1, self.board, self.plots, row2, self.server, self.runs],
                         layout=widgets.Layout(width="100%"))
        self.add_class("cbnb-dashboard")
        if start:
            self.poller.start()

    @property
    def panels(self) -> list:
        # getattr: close() also runs from ipywidgets' __del__ on a Dashboard whose __init__ raised half way.
        names = ("submit", "stream", "board", "kvmap", "plots", "config", "server", "runs")
        return [p for p in (getattr(self, n, None) for n in names) if p is not None]

    def close(self) -> None:
        """Stop the poller and close every widget of the dashboard (panels, rows, layouts), so that nothing keeps
        the engine alive."""
        poller = getattr(self, "poller", None)
        if poller is not None:
            poller.stop()
        for w in [*self.panels, *getattr(self, "_rows", []), self]:
            layout = getattr(w, "layout", None)
            if w is not self:
                w.close()
            if layout is not None:
                layout.close()
        super().close()

    def __repr__(self) -> str:
        return f"Dashboard({self.engine!r}, poller={'running' if self.poller.running else 'stopped'})"
