"""A browser harness without Jupyter: a panel's ES module is imported into a blank Chromium page and rendered
with a stand-in for the anywidget model (get/set/on/off/save_changes/send, `msg:custom`, a widget manager).

Fast (no server, no kernel) and good for front-end logic and drawing cost; it cannot see comm or kernel bugs
(the JupyterLab test covers those). Bytes traitlets are passed as DataViews, as the real widget manager does.
"""

from __future__ import annotations

import base64
import json
from typing import Any

MOUNT_JS = r"""
async ({ esm, css, state, models }) => {
  const revive = (v) => {
    if (v && typeof v === "object" && !Array.isArray(v)) {
      if ("__b64__" in v) {
        const bin = atob(v.__b64__); const u = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) u[i] = bin.charCodeAt(i);
        return new DataView(u.buffer);
      }
      const o = {}; for (const [k, x] of Object.entries(v)) o[k] = revive(x); return o;
    }
    return Array.isArray(v) ? v.map(revive) : v;
  };
  const makeModel = (init) => {
    const data = revive(init), listeners = {}, saved = [], sent = [];
    const emit = (ev, ...a) => (listeners[ev] || []).slice().forEach((cb) => cb(...a));
    const model = {
      get: (k) => data[k],
      set: (k, v) => { if (data[k] === v) return; data[k] = v; emit(`change:${k}`, model, v); emit("change", model); },
      on: (ev, cb) => { for (const e of ev.split(/\s+/)) (listeners[e] = listeners[e] || []).push(cb); },
      off: (ev, cb) => { listeners[ev] = (listeners[ev] || []).filter((c) => c !== cb); },
      save_changes: () => saved.push(Object.keys(data)),
      send: (content) => sent.push(content),
      widget_manager: { get_model: async (id) => others[id] },
    };
    return { model, data, saved, sent, emit };
  };
  // A fresh document has lost the styles plotly.js injects when it loads: load it again.
  delete globalThis.Plotly; globalThis.__cbnbPlotly = null;
  const others = {};
  for (const [id, st] of Object.entries(models || {})) others[id] = makeModel(st).model;
  const h = makeModel(state);
  window.__h = {
    ...h,
    pySet: (k, v) => h.model.set(k, revive(v)),                 // a traitlet change from Python
    pySend: (content) => h.emit("msg:custom", content, []),     // widget.send() from Python
  };
  if (css) { const s = document.createElement("style"); s.textContent = css; document.head.append(s); }
  const mod = await import(URL.createObjectURL(new Blob([esm], { type: "text/javascript" })));
  const w = mod.default;
  const el = document.createElement("div"); el.id = "root"; el.style.width = "900px"; document.body.append(el);
  if (w.initialize) await w.initialize({ model: h.model });
  window.__h.cleanup = await w.render({ model: h.model, el });
  return true;
}
"""


def to_js(value: Any) -> Any:
    """Widget state -> JSON for the page (bytes become {"__b64__": ...}, revived as DataView)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__b64__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {k: to_js(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_js(v) for v in value]
    return value


def widget_state(widget: Any) -> dict[str, Any]:
    skip = {"_esm", "_css", "_anywidget_id", "layout", "_dom_classes"}
    return {k: to_js(v) for k, v in widget.get_state().items() if k not in skip}


def mount(page: Any, widget: Any, state: dict[str, Any] | None = None, models: dict[str, Any] | None = None) -> None:
    """Render `widget`'s ES module in `page` with its current state (or `state`), and extra `models` by id."""
    page.set_content("<!doctype html><html><body></body></html>")
    page.evaluate(MOUNT_JS, {"esm": str(widget._esm), "css": str(widget._css),
                             "state": json.loads(json.dumps(state if state is not None else widget_state(widget))),
                             "models": models or {}})


def py_set(page: Any, name: str, value: Any) -> None:
    """Simulate a traitlet change sent from Python, and wait for the panel's next frame (panels draw in rAF)."""
    page.evaluate("""async ([k, v]) => { window.__h.pySet(k, v);
        await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))); }""", [name, to_js(value)])
