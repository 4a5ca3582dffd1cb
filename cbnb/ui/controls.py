"""`ControlsPanel`: the dashboard's top bar, for teaching: step-by-step mode and presentation mode.

- Pause / Step / Resume and a slow-motion cap (steps per second): `Engine.pause`, `step`, `resume`,
  `set_step_rate`. While paused every panel shows the state after the last step; submissions are admitted and wait
  PENDING (the bar counts them), so a lone prompt can be followed PENDING -> PREFILLING (chunk by chunk) ->
  DECODING -> FINISHED one step at a time.
- Presentation: a font scale (1x-2x) for projectors, applied to every cbnb panel of the page (the CSS variable
  ``--cbnb-scale`` on ``<html>``); colours follow JupyterLab's light or dark theme on their own.
"""

from __future__ import annotations

import threading
from typing import Any

import traitlets

from . import _assets
from .base import Panel
from .poller import Frame

__all__ = ["ControlsPanel", "STEP_RATES"]

#: The slow-motion choices offered (steps per second; 0 = no cap).
STEP_RATES = [0.0, 0.5, 1.0, 2.0, 5.0, 10.0]


def _per_s(rate: float) -> str:
    """A step rate in words: "1 step per second", "0.5 steps per second"."""
    return f"{rate:g} step{'' if rate == 1 else 's'} per second"


class ControlsPanel(Panel):
    """Step mode and presentation controls.

    Synced state: `paused`, `step_rate` (steps/s, 0 = no cap), `last_step` (the newest step planned), `waiting`
    (requests PENDING), `running` (requests PREFILLING or DECODING), `engine_state`, `rates` (choices),
    `font_scale` (1.0-2.0; set by the front-end), `stepping` (a single step is running).
    """

    _esm = _assets.esm("controls.js")
    paused = traitlets.Bool(False).tag(sync=True)
    step_rate = traitlets.Float(0.0).tag(sync=True)
    rates = traitlets.List(traitlets.Float(), default_value=STEP_RATES).tag(sync=True)
    last_step = traitlets.Int(0).tag(sync=True)
    waiting = traitlets.Int(0).tag(sync=True)
    running = traitlets.Int(0).tag(sync=True)
    engine_state = traitlets.Unicode("").tag(sync=True)
    stepping = traitlets.Bool(False).tag(sync=True)
    font_scale = traitlets.Float(1.0).tag(sync=True)

    @traitlets.validate("font_scale")
    def _valid_scale(self, proposal: Any) -> float:
        v = float(proposal["value"])
        return min(2.0, max(1.0, v)) if v == v else 1.0

    def _setup(self) -> None:
        self._note = ""  # the last `engine_note` shown
        self._sync()
        # A dashboard made over an engine that already ran (a re-run cell) starts where the engine is: its newest
        # step and that step's summary, not "step 0".
        ev = self._last_plan()
        step = int(ev.step) if ev is not None else int(getattr(getattr(self.engine, "core", None), "step_id", 0) or 0)
        if step:
            self.last_step = step
            self.show(self._summary(step, ev) + (" Paused." if self.paused else ""), "info")

    def _sync(self) -> None:
        eng = self.engine
        with self.hold_sync():
            self.paused = bool(getattr(eng, "paused", False))
            self.step_rate = float(getattr(eng, "step_rate", None) or 0.0)

    # ------------------------------------------------------------------------------------------ actions
    def _no_step_mode(self) -> bool:
        """True (and says why) for an engine-like without the step mode (`cbnb.Engine` and `cbnb.sim.SimEngine` both
        have it: `cbnb.engine.step_mode`)."""
        if all(hasattr(self.engine, a) for a in ("pause", "step", "resume", "set_step_rate")):
            return False
        self.show("This engine has no step mode (pause / step / resume); it runs at its own pace.", "info")
        return True

    def pause(self) -> None:
        """Pause after the step now running (`Engine.pause`)."""
        if self._no_step_mode():
            return
        self.engine.pause(wait=False)
        self.paused = True
        self.show("Paused: panels show the state after the last step; submissions wait PENDING. "
                  "Step runs one scheduling step.", "info")
        self.poller.poke()

        hold = getattr(self.engine, "_hold", None)  # waits for the hold only (pause(wait=True) would pause again)

        def settled() -> None:
            # The step running at the click ends after this poke: poll again once the loop holds, so "paused
            # after step N" names that step now rather than at the next poll.
            try:
                if hold(30.0) and self.engine.paused:
                    self.poller.poke()
            except Exception:  # a stopped or dead engine: the poller reports that itself
                pass

        if hold is not None:
            threading.Thread(target=settled, name="cbnb-ui-pause", daemon=True).start()

    def resume(self) -> None:
        """Let steps run freely again (`Engine.resume`)."""
        if self._no_step_mode():
            return
        self.engine.resume()
        self.paused = False
        rate = float(getattr(self.engine, "step_rate", None) or 0.0)
        self.show(f"Running in slow motion: at most {_per_s(rate)}." if rate else "Running.", "ok")
        self.poller.poke()

    def step(self, wait: bool = False, timeout: float = 60.0) -> bool:
        """Run exactly one scheduling step (`Engine.step`) on a worker thread, then hold.

        Returns:
            False when a step is already running; with `wait`, True once this step completed.
        """
        if self.stepping or self._no_step_mode():
            return False
        self.stepping = True
        self.paused = True

        def work() -> None:
            try:
                sid = self.engine.step(timeout=timeout)
                self.show(self._describe(sid), "ok" if sid is not None else "info")
            except Exception as e:
                self.show(f"Step failed: {type(e).__name__}: {e}", "error")
            finally:
                self.stepping = False
                self.poller.poke()

        t = threading.Thread(target=work, name="cbnb-ui-step", daemon=True)
        t.start()
        if wait:
            t.join(timeout)
        return True

    def set_step_rate(self, steps_per_s: float) -> None:
        """Slow motion: at most `steps_per_s` steps per second (0: no cap)."""
        if self._no_step_mode():
            return
        self.engine.set_step_rate(steps_per_s or None)
        self._sync()
        self.show(f"Slow motion: at most {_per_s(steps_per_s)}." if steps_per_s else "Slow motion off.", "info")

    def _describe(self, step_id: int | None) -> str:
        """One line about a step from its StepPlanned event (after Step: the engine holds again)."""
        if step_id is None:
            return "Nothing to step: no request is waiting or running."
        return self._summary(step_id, self._plan_of(step_id)) + " Paused."

    def _plan_of(self, step_id: int) -> Any:
        log = self.engine.events
        recent, _, _ = log.since(max(0, log.cursor - 5000))  # the step is among the newest events
        return next((e for e in reversed(recent) if e.kind == "step_planned" and e.step == step_id), None)

    def _last_plan(self) -> Any:
        """The newest StepPlanned event in the log (None: none, e.g. telemetry off)."""
        log = getattr(self.engine, "events", None)
        if log is None:
            return None
        recent, _, _ = log.since(max(0, log.cursor - 5000))
        return next((e for e in reversed(recent) if e.kind == "step_planned"), None)

    @staticmethod
    def _summary(step_id: int, ev: Any) -> str:
        """"Step N: who ran, who was left out (and why)." from the step's StepPlanned event `ev` (None: unknown)."""
        if ev is None:
            return f"Step {step_id} ran."
        chunks = [f"{t[0]} prefill {t[2]} tokens" for t in ev.taken if t[1] == "prefill"]
        decodes = sum(1 for t in ev.taken if t[1] == "decode")
        left = sum(len(ids) for _r, ids, _d in ev.skipped)
        parts = chunks + ([f"{decodes} decode{'s' if decodes != 1 else ''}"] if decodes else [])
        text = f"Step {step_id}: " + (", ".join(parts) if parts else "nothing scheduled")
        if left:
            reasons = ", ".join(sorted({r.replace('_', ' ') for r, _ids, _d in ev.skipped}))
            text += f"; {left} left out ({reasons})"
        return text + "."

    def _on_pause(self, _msg: dict) -> None:
        self.pause()

    def _on_resume(self, _msg: dict) -> None:
        self.resume()

    def _on_step(self, _msg: dict) -> None:
        self.step()

    def _on_rate(self, msg: dict) -> None:
        try:
            rate = float(msg.get("value") or 0.0)
        except (TypeError, ValueError):
            self.show(f"slow motion: not a number: {msg.get('value')!r}", "error")
            return
        self.set_step_rate(rate)

    # ------------------------------------------------------------------------------------------ poller
    def _needs(self) -> set[str]:
        return {"requests"}

    def _values(self, frame: Frame) -> dict[str, Any]:
        eng = self.engine
        out: dict[str, Any] = {"paused": bool(getattr(eng, "paused", False)),
                               "step_rate": float(getattr(eng, "step_rate", None) or 0.0),
                               "engine_state": frame.engine_state}
        for e in reversed(frame.events):
            if getattr(e, "kind", "") == "step_planned":
                out["last_step"] = int(e.step)
                # Slow motion: the message line follows the steps, one summary per step (not a stale "Running.").
                if out["step_rate"] and not out["paused"] and not self.stepping:
                    out["message"] = f"{self._summary(int(e.step), e)} Slow motion: at most {_per_s(out['step_rate'])}."
                    out["message_kind"] = "info"
                break
        if frame.requests is not None:
            states = [getattr(r.state, "name", str(r.state)) for r in frame.requests]
            out["waiting"] = states.count("PENDING")
            out["running"] = states.count("PREFILLING") + states.count("DECODING")
        note = self.engine_note()
        if note != self._note:  # said once when it happens (and cleared when it no longer holds)
            if note:
                out["message"], out["message_kind"] = note, "error"
            elif self.message == self._note:
                out["message"], out["message_kind"] = "", "info"
            self._note = note
        return out
