// Helpers shared by every cbnb panel. cbnb.ui._assets.esm() prepends this file to each panel's module
// (no build step), so the panel modules call these functions directly.

const CBNB_TERMINAL = new Set(["FINISHED", "FAILED", "CANCELLED"]);

const CBNB_CONTROLS = new Set(["input", "select", "textarea", "button"]);

function cbnbEl(tag, cls, text) {
  const e = document.createElement(tag);
  // JupyterLab matches shortcut selectors on the focused element itself before looking for this attribute on
  // its ancestors, so controls carry it too (else arrow keys on a slider move between notebook cells).
  if (CBNB_CONTROLS.has(tag)) e.setAttribute("data-lm-suppress-shortcuts", "true");
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

// Panel frame: a titled box with a message line at the bottom. Returns {root, body, setMessage}.
function cbnbFrame(el, model, cls, title) {
  const root = cbnbEl("div", `cbnb-panel ${cls}`);
  // Keys typed into the panel's controls (arrows on a slider...) are not notebook shortcuts.
  root.setAttribute("data-lm-suppress-shortcuts", "true");
  const head = cbnbEl("div", "cbnb-panel-title", title);
  const body = cbnbEl("div", "cbnb-panel-body");
  const msg = cbnbEl("div", "cbnb-message");
  root.append(head, body, msg);
  el.appendChild(root);
  const showMessage = () => {
    const text = model.get("message") || "";
    msg.textContent = text;
    msg.className = `cbnb-message cbnb-msg-${model.get("message_kind") || "info"}`;
    msg.style.display = text ? "" : "none";
  };
  model.on("change:message", showMessage);
  model.on("change:message_kind", showMessage);
  showMessage();
  const cleanup = () => {
    model.off("change:message", showMessage);
    model.off("change:message_kind", showMessage);
  };
  return { root, head, body, msg, cleanup };
}

// Record the delay between Python reading the engine (_stamp, time.time()) and this model seeing the update,
// and the delay from the oldest engine event behind it (_event_t). Read by the browser tests.
function cbnbTrackLatency(model, panel) {
  model.on("change:_stamp", () => {
    const now = Date.now() / 1000;
    const stamp = model.get("_stamp");
    const ev = model.get("_event_t");
    if (!stamp) return;
    const log = (globalThis.__cbnbLatency = globalThis.__cbnbLatency || []);
    log.push({ panel, update: now - stamp, event: ev ? now - ev : null, at: now });
    if (log.length > 20000) log.splice(0, log.length - 20000);
  });
}

// Coalesce DOM work into the next animation frame: a burst of widget messages is recorded as it arrives and
// drawn once, so one panel's drawing does not hold up the next message.
function cbnbOnFrame(fn) {
  let pending = false;
  return () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; fn(); });
  };
}

// Record when the panel's DOM shows an update (latency from _stamp to drawn), next to the arrival latency.
function cbnbRecordRender(model, panel) {
  const stamp = model.get("_stamp");
  if (!stamp) return;
  const log = (globalThis.__cbnbRender = globalThis.__cbnbRender || []);
  const last = log.length ? log[log.length - 1] : null;
  if (last && last.panel === panel && last.stamp === stamp) return;
  log.push({ panel, stamp, render: Date.now() / 1000 - stamp, at: Date.now() / 1000 });
  if (log.length > 20000) log.splice(0, log.length - 20000);
}

// Bytes traitlets arrive as DataView (or ArrayBuffer / typed array): view them as bytes without copying.
function cbnbBytes(v) {
  if (!v) return new Uint8Array(0);
  if (v instanceof Uint8Array) return v;
  if (v instanceof ArrayBuffer) return new Uint8Array(v);
  if (ArrayBuffer.isView(v)) return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
  return new Uint8Array(0);
}

// float32 bytes -> Float32Array (copied when the offset is not 4-aligned).
function cbnbFloats(v) {
  const b = cbnbBytes(v);
  if (b.byteOffset % 4 === 0) return new Float32Array(b.buffer, b.byteOffset, Math.floor(b.byteLength / 4));
  return new Float32Array(b.slice().buffer);
}

function cbnbFmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function cbnbBytesText(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n.toFixed(0)} ${units[i]}`;
}

function cbnbStateBadge(state) {
  return cbnbEl("span", `cbnb-badge cbnb-state-${String(state).toLowerCase()}`, state);
}
