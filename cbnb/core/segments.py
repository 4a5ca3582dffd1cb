"""Run segments: what a reconfigure's `RunStarted` marker records, shared by both engines (torch-free).

Every successful reconfigure of `cbnb.Engine` and of `cbnb.sim.SimEngine` starts a run segment the same way
(`mark_reconfigure`): a `RunStarted` event ("reconfigure", the changed fields, the old and new plain config values)
at the step number reached so far (step numbers go on across a reconfigure: `carry_step_id`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["config_values", "config_changes", "mark_reconfigure", "carry_step_id"]


def config_values(config: Any) -> dict[str, Any]:
    """A resolved config's plain fields by name (numbers, strings, flags, tuples of them; what a reconfigure's
    `RunStarted` marker records). Objects such as compile configs are left out: an event is plain data."""
    plain = (type(None), bool, int, float, str)
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)):
            out[f.name] = v
    return out


def config_changes(old: Any, new: Any) -> str:
    """The fields of two (resolved) configs that differ, as "page_size=16, safety_margin=0.3" ("no change")."""
    parts = []
    for f in dataclasses.fields(new):
        a, b = getattr(old, f.name, None), getattr(new, f.name, None)
        if a != b:
            parts.append(f"{f.name}={b!r}" if isinstance(b, str) else f"{f.name}={b}")
    return ", ".join(parts) or "no change"


def carry_step_id(previous_core: Any, core: Any) -> None:
    """Step numbers go on across a reconfigure (events, plots and stories tell the runs apart by them)."""
    if previous_core is not None:
        core.step_id = previous_core.step_id


def mark_reconfigure(recorder: Any, before: Any, after: Any) -> None:
    """Start a run segment: the `RunStarted` marker of a reconfigure from resolved config `before` to `after`."""
    recorder.mark_run("reconfigure", config_changes(before, after), before=config_values(before),
                      after=config_values(after))
