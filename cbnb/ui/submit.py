"""`SubmitPanel`: a prompt box with max_new_tokens and temperature, a Submit button, and a standard-workload button."""

from __future__ import annotations

from typing import Any

import traitlets

from . import _assets
from .base import Panel

__all__ = ["SubmitPanel"]


class SubmitPanel(Panel):
    """Submit prompts to the engine from the notebook.

    Text prompts get the model's chat template when its tokenizer has one (`engine.submit(chat=None)`).
    Temperature 0 means greedy decoding; above 0 it samples at that temperature.

    Synced state: `prompt` (str), `max_new_tokens` (int >= 1), `temperature` (float >= 0), `workload` (a name from
    `cbnb.lab.workloads.WORKLOADS`), `workload_scale` (float in (0, 1]), `chat_template` (bool, read-only),
    `last_ids` (ids of the latest submissions).

    Bad input (empty prompt, out-of-range numbers, a stopped engine) is shown on the panel's message line.
    """

    _esm = _assets.esm("submit.js")
    prompt = traitlets.Unicode("").tag(sync=True)
    max_new_tokens = traitlets.Int(64).tag(sync=True)
    temperature = traitlets.Float(0.0).tag(sync=True)
    workloads = traitlets.List(traitlets.Unicode()).tag(sync=True)
    workload = traitlets.Unicode("cpu-32").tag(sync=True)
    workload_scale = traitlets.Float(0.25).tag(sync=True)
    chat_template = traitlets.Bool(False).tag(sync=True)
    last_ids = traitlets.List(traitlets.Unicode()).tag(sync=True)

    def _setup(self) -> None:
        from collections import deque

        from ..lab.workloads import WORKLOADS

        # Gesture ids of the submissions handled (newest last): a message that arrives twice for one click (a
        # double click, a re-sent message) submits once.
        self._nonces: deque[str] = deque(maxlen=64)

        # nanovllm-256 is a GPU workload for a random-init model shape; the rest run on the bundled model.
        self.workloads = [w for w in WORKLOADS if w != "nanovllm-256"] or list(WORKLOADS)
        tok = getattr(self.engine, "tokenizer", None)
        self.chat_template = bool(tok is not None and getattr(tok, "chat_template", None))

    # ------------------------------------------------------------------------------------------ actions
    def submit(self, prompt: str | None = None, max_new_tokens: int | None = None,
               temperature: float | None = None) -> Any:
        """Submit one prompt (default: the panel's fields). Returns the `RequestHandle`, or None when the input
        was refused (the reason is shown on the panel)."""
        prompt = self.prompt if prompt is None else prompt
        note = self.engine_note()
        if note:  # a stopped engine, or one the notebook replaced: the prompt would go where nobody looks
            self.show(f"Not submitted. {note}", "error")
            return None
        mnt = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        temp = self.temperature if temperature is None else temperature
        if not isinstance(prompt, str) or not prompt.strip():
            self.show("The prompt is empty: type a question or instruction first.", "error")
            return None
        try:
            temp = float(temp)
            if isinstance(mnt, bool) or float(mnt) != int(float(mnt)):
                raise ValueError
            mnt = int(float(mnt))
        except (TypeError, ValueError, OverflowError):
            self.show(f"max_new_tokens must be a whole number and temperature a number; got {mnt!r}, {temp!r}.",
                      "error")
            return None
        if mnt < 1:
            self.show(f"max_new_tokens must be at least 1; got {mnt}.", "error")
            return None
        if not (temp >= 0) or temp > 10:
            self.show(f"temperature must be between 0 (greedy) and 10; got {temp}.", "error")
            return None
        sampling = {"do_sample": True, "temperature": temp} if temp > 0 else {}
        try:
            handle = self.engine.submit(prompt, max_new_tokens=mnt, **sampling)
        except Exception as e:  # ValueError (bad prompt), EngineStoppedError, ...
            self.show(f"Not submitted: {e}", "error")
            return None
        how = "chat template applied, " if self.chat_template else ""
        mode = f"temperature {temp:g}" if temp > 0 else "greedy"
        self.last_ids = [handle.request_id]
        n_prompt = len(handle.prompt_token_ids)
        cap = handle.max_new_tokens
        limit = f"up to {mnt} new tokens"
        if cap is not None and cap < mnt:  # lowered to the model's max positions
            limit = (f"up to {cap} new tokens (asked {mnt}: the model's {n_prompt + cap} max positions minus the "
                     f"{n_prompt} prompt tokens)")
        self.show(f"Submitted {handle.request_id}: {n_prompt} prompt tokens ({how}{mode}), {limit}.", "ok")
        return handle

    def run_workload(self, name: str | None = None, scale: float | None = None) -> list[Any]:
        """Submit a standard workload (`cbnb.lab.workloads.get_workload(name, scale=scale)`; EOS ignored, greedy).

        Returns:
            the `RequestHandle`s ([] when refused; the reason is shown on the panel).
        """
        from ..lab.workloads import get_workload

        name = self.workload if name is None else name
        note = self.engine_note()
        if note:
            self.show(f"Workload not started. {note}", "error")
            return []
        scale = self.workload_scale if scale is None else scale
        try:
            scale = float(scale)
            if not (0 < scale <= 1):
                raise ValueError(f"scale must be in (0, 1]; got {scale}")
            wl = get_workload(name, scale=scale, vocab_size=getattr(self.engine, "vocab_size", None))
        except Exception as e:
            self.show(f"Workload not started: {e}", "error")
            return []
        handles = []
        # The plots start a new segment here, labelled with the workload.
        self.engine.reset_stats(f"workload {wl.name} (scale {scale:g})", cause="workload")
        try:
            for p, n in zip(wl.prompts, wl.max_new_tokens):
                handles.append(self.engine.submit(p, max_new_tokens=n, ignore_eos=True))
        except Exception as e:
            self.show(f"Workload stopped after {len(handles)} of {wl.num_requests} requests: {e}", "error")
            return handles
        self.last_ids = [h.request_id for h in handles]
        self.show(f"Submitted workload {wl.name} (scale {scale:g}): {wl.num_requests} requests, "
                  f"{wl.prompt_tokens} prompt tokens, {wl.output_tokens} new tokens.", "ok")
        return handles

    # ------------------------------------------------------------------------------------------ front-end
    def _on_submit(self, msg: dict) -> None:
        nonce = msg.get("nonce")
        if isinstance(nonce, str) and nonce:
            if nonce in self._nonces:
                return  # this gesture was submitted already
            self._nonces.append(nonce)
        try:
            self._submit_msg(msg)
        finally:
            if isinstance(nonce, str) and nonce:
                self.send({"kind": "submitted", "nonce": nonce})  # the front-end enables Submit again

    def _submit_msg(self, msg: dict) -> None:
        for key in ("max_new_tokens", "temperature"):
            if key in msg and msg[key] is None:  # an empty or non-numeric field in the browser
                self.show(f"{key} is empty or not a number: enter a value.", "error")
                return
        with self.hold_sync():
            for key in ("prompt", "max_new_tokens", "temperature"):
                if key in msg:
                    try:
                        setattr(self, key, msg[key])
                    except traitlets.TraitError:
                        pass  # validated (and reported) by submit()
        self.submit(msg.get("prompt", self.prompt), msg.get("max_new_tokens", self.max_new_tokens),
                    msg.get("temperature", self.temperature))

    def _on_workload(self, msg: dict) -> None:
        self.run_workload(msg.get("name") or None, msg.get("scale"))
