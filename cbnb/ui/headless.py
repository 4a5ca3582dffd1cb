"""A dashboard with no front-end, for measuring the UI's cost: ``python -m cbnb.bench --variants dashboard=on``.

It builds a real `Dashboard` and runs its update machinery exactly as in a notebook: the poller thread, every
panel's state computation and traitlet updates, plots and the KV page map (treated as visible, the most expensive
case). With no kernel, each widget's comm is replaced by one that serialises every outgoing message to JSON as the
kernel's session would (buffers stay binary), then drops it; only the socket write is missing.
"""

from __future__ import annotations

import json
import threading
from typing import Any

__all__ = ["HeadlessDashboard", "attach_headless_dashboard"]


class _SerializingComm:
    """A comm that JSON-encodes what a widget sends (as `jupyter_client.Session` would) and discards it."""

    kernel = True  # ipywidgets only sends when its comm has a kernel

    def __init__(self, comm_id: str) -> None:
        self.comm_id = comm_id  # the widget keeps its model id
        self.messages = 0
        self.json_bytes = 0
        self.buffer_bytes = 0
        self._lock = threading.Lock()

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        text = json.dumps({"data": data, "metadata": metadata or {}}, default=str)
        n = sum(memoryview(b).nbytes for b in buffers or ())
        with self._lock:
            self.messages += 1
            self.json_bytes += len(text)
            self.buffer_bytes += n

    def on_msg(self, callback: Any) -> None:
        pass

    def on_close(self, callback: Any) -> None:
        pass

    def close(self, *args: Any, **kwargs: Any) -> None:
        pass


class HeadlessDashboard:
    """Handle returned by `attach_headless_dashboard`.

    Attributes:
        dashboard: the `Dashboard`.
        poller: its `Poller` (`ticks`, `tick_seconds` and `errors` tell what it did).
    """

    def __init__(self, dashboard: Any) -> None:
        self.dashboard = dashboard
        self.poller = dashboard.poller
        self.comms = []
        for p in dashboard.panels:
            old = p.comm
            c = _SerializingComm(old.comm_id)
            old.close()  # unregisters it (else the comm manager keeps the panel, hence the engine, alive)
            p.comm = c
            self.comms.append(c)

    def stats(self) -> dict[str, Any]:
        """Poller ticks and time, and the messages the panels sent (count, JSON bytes, binary bytes)."""
        p = self.poller
        return {"ticks": p.ticks, "tick_seconds": p.tick_seconds,
                "mean_tick_ms": 1000 * p.tick_seconds / p.ticks if p.ticks else 0.0, "errors": list(p.errors),
                "messages": sum(c.messages for c in self.comms),
                "json_bytes": sum(c.json_bytes for c in self.comms),
                "buffer_bytes": sum(c.buffer_bytes for c in self.comms)}

    def close(self) -> None:
        """Stop the poller and close the widgets."""
        self.dashboard.close()


def attach_headless_dashboard(engine: Any, *, max_hz: float = 10.0) -> HeadlessDashboard:
    """Attach a live, front-end-less `Dashboard` to `engine` (its poller starts at once). Call `.close()` after."""
    from .dashboard import Dashboard

    dash = Dashboard(engine, max_hz=max_hz, always_snapshot=True, start=False)
    handle = HeadlessDashboard(dash)  # swaps the comms before the first update
    dash.poller.start()
    return handle
