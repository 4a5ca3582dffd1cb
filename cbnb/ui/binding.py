"""Whether a dashboard's engine is still the notebook's: stopped, or replaced because its cell was re-run.

Re-running ``engine = cbnb.Engine(...)`` binds the name to a new engine while a dashboard displayed earlier keeps
the old one (it holds a reference, so the old engine even keeps running). `EngineBinding` remembers the names of the
kernel's namespace that held the engine when the dashboard was made, and `note()` says when one of them now names
another engine, or when the engine was stopped: the dashboard shows it, and its Submit refuses to send a prompt
where the user no longer looks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EngineBinding"]


def _user_ns() -> dict[str, Any] | None:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipywidgets
        return None
    ip = get_ipython()
    ns = getattr(ip, "user_ns", None)
    return ns if isinstance(ns, dict) else None


def _engine_like(obj: Any) -> bool:
    return callable(getattr(obj, "submit", None)) and callable(getattr(obj, "requests_snapshot", None))


class EngineBinding:
    """The names that held `engine` in the kernel's namespace when made (none outside a kernel).

    Args:
        engine: the dashboard's engine.
        ns: the namespace to watch (default: IPython's user namespace, when there is one).
    """

    def __init__(self, engine: Any, ns: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.ns = ns if ns is not None else _user_ns()
        self.names = sorted(k for k, v in (self.ns or {}).items() if v is engine and not k.startswith("_"))

    def replaced_by(self) -> str | None:
        """A name that held the engine and now names another engine (e.g. "engine"), else None."""
        ns = self.ns
        if not ns:
            return None
        for name in self.names:
            obj = ns.get(name)
            if obj is not self.engine and obj is not None and _engine_like(obj):
                return name
        return None

    def state(self) -> str:
        """The engine's lifecycle state ("created", "running", "stopped", "dead"; "running" when it has none)."""
        return str(getattr(self.engine, "state", "running"))

    def note(self) -> str:
        """"" while the engine is the notebook's and alive; else one sentence on what happened and what to do."""
        name = self.replaced_by()
        if name is not None:
            stopped = self.state() in ("stopping", "stopped", "dead")
            return (f"`{name}` now names another engine (its cell was re-run): this dashboard still shows the old "
                    f"one{', which is stopped' if stopped else ''}. Run `Dashboard({name})` for the new engine"
                    + ("" if stopped else f", and stop the old one with this dashboard's `.engine.stop()`") + ".")
        if self.state() in ("stopping", "stopped", "dead"):
            return ("This dashboard's engine is stopped" + (" (it died: see its error)" if self.state() == "dead"
                                                           else "") + ": nothing runs and Submit is off. Start a "
                    "new engine and a new Dashboard.")
        return ""
