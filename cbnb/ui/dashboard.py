"""`Dashboard`: all panels over one engine, fed by one poller thread, sharing one request selection."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from .binding import EngineBinding
from .board import RequestBoardPanel
from .config_panel import ConfigPanel
from .controls import ControlsPanel
from .kvmap import KVPageMapPanel
from .live import in_kernel, route_status
from .plots import LivePlotsPanel
from .poller import Poller
from .runs_panel import RunsPanel
from .selection import Selection
from .server_panel import ServerPanel
from .stream import TokenStreamPanel
from .submit import SubmitPanel
from .timeline import TimelinePanel
from .why import WhyPanel

__all__ = ["Dashboard"]


class Dashboard(widgets.VBox):
    """The engine's dashboard: Controls (step mode, presentation), Submit, Token stream, Request board, Request
    timeline, Why?, Live plots, KV page map, Config, Server and Runs.

    Args:
        engine: a `cbnb.Engine` or a `cbnb.sim.SimEngine` (started or not; submitting starts it): the panels use
            only the shared protocol, `cbnb.engine.engine_like.EngineLike` (step mode included).
        max_hz: update rate cap of the shared poller, in (0, 10].
        always_snapshot: take KV snapshots on every poll, also while the page map is off screen (the default: data
            never waits for the browser); False: only while a view of the map reports itself on screen.
        start: start the poller now.

    Attributes:
        controls, submit, stream, board, timeline, why, kvmap, plots, config, server, runs: the panels (each also
            usable alone).
        poller: the `Poller` feeding them.
        selection: the shared `Selection`: a request clicked in the board, the stream, the timeline or the page map
            opens its story in `why` and lights up its blocks in `kvmap`.

    Display it as the last expression of a cell. `close()` stops the poller and closes the widgets.

    While a cell runs (a sweep, `engine.generate`, your own loop), clicks act at once and the panels keep drawing:
    the poller pushes from its own thread, and the panels' messages are handled on cbnb's kernel subshell
    (`cbnb.ui.live`, ipykernel >= 7.4). `live` says whether that holds in this kernel; where it does not, the
    Controls panel says so, and clicks wait for the running cell.
    """

    def __init__(self, engine: Any, *, max_hz: float = 10.0, always_snapshot: bool = True,
                 start: bool = True) -> None:
        self.engine = engine
        self.poller = Poller(engine, max_hz=max_hz)
        kw = {"poller": self.poller}
        self.controls = ControlsPanel(engine, **kw)
        self.submit = SubmitPanel(engine, **kw)
        self.stream = TokenStreamPanel(engine, **kw)
        self.board = RequestBoardPanel(engine, **kw)
        self.timeline = TimelinePanel(engine, **kw)
        self.why = WhyPanel(engine, **kw)
        self.kvmap = KVPageMapPanel(engine, always_snapshot=always_snapshot, **kw)
        self.plots = LivePlotsPanel(engine, **kw)
        self.config = ConfigPanel(engine, **kw)
        self.server = ServerPanel(engine, **kw)
        self.runs = RunsPanel(engine, **kw)
        self.selection = Selection()
        self._wire_selection()
        self.binding = EngineBinding(engine)  # says when the notebook replaced or stopped the engine
        for p in self.panels:
            p.binding = self.binding
        for p, width in ((self.submit, "50%"), (self.stream, "50%"), (self.kvmap, "40%"), (self.config, "60%")):
            p.layout.width, p.layout.min_width = width, "360px"
        row1 = widgets.HBox([self.submit, self.stream], layout=widgets.Layout(width="100%", flex_flow="row wrap"))
        row2 = widgets.HBox([self.kvmap, self.config], layout=widgets.Layout(width="100%", flex_flow="row wrap"))
        self._rows = [row1, row2]
        super().__init__([self.controls, row1, self.board, self.timeline, self.why, self.plots, row2,
                          self.server, self.runs],
                         layout=widgets.Layout(width="100%"))
        self.add_class("cbnb-dashboard")
        if not self.controls.routed and in_kernel():
            why = self.live
            self.controls.show(why[:1].upper() + why[1:] + ".", "info")
        if start:
            self.poller.start()

    def _wire_selection(self) -> None:
        """Every panel reports clicks and hovers to the shared selection; those with an `on_selection` follow it."""
        for p in self.panels:
            p.selection = self.selection
            listener = getattr(p, "on_selection", None)
            if listener is not None:
                self.selection.subscribe(listener)

    @property
    def panels(self) -> list:
        # getattr: close() also runs from ipywidgets' __del__ on a Dashboard whose __init__ raised half way.
        names = ("controls", "submit", "stream", "board", "timeline", "why", "kvmap", "plots", "config", "server",
                 "runs")
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

    @property
    def live(self) -> str:
        """Whether clicks act while a cell runs in this kernel, and why not (`cbnb.ui.live.route_status`)."""
        return route_status()

    def __repr__(self) -> str:
        state = str(getattr(self.engine, "state", "running"))
        if state in ("stopping", "stopped", "dead"):  # the poller may still tick, but nothing will change
            return f"Dashboard({self.engine!r}, engine {state}: the panels show its last state)"
        note = self.binding.replaced_by() if getattr(self, "binding", None) is not None else None
        return (f"Dashboard({self.engine!r}, poller={'running' if self.poller.running else 'stopped'}"
                + (f", replaced: `{note}` names another engine" if note else "") + ")")
