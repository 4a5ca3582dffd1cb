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
  const offLive = cbnbWatchKernel(model, root);
  const cleanup = () => {
    model.off("change:message", showMessage);
    model.off("change:message_kind", showMessage);
    offLive();
  };
  return { root, head, body, msg, cleanup };
}

// A live panel hears from the kernel every couple of seconds (the poller's heartbeat `_beat`, sent from its own
// thread, so a busy cell does not stop it). Silence for CBNB_STALE_S means a restarted, shut down or stuck
// kernel: the panel says so, and a click on it explains instead of doing nothing. Armed by the first beat (a
// panel rendered without a kernel, as in the front-end harness, never goes stale).
const CBNB_STALE_S = 8;
function cbnbWatchKernel(model, root) {
  let last = performance.now();
  let stale = false;
  const banner = cbnbEl("div", "cbnb-stale-banner");
  banner.style.display = "none";
  root.prepend(banner);
  const setStale = (on, secs) => {
    // The first silent panel on the page (in document order) says it all; the others (a dashboard has 11) say it
    // briefly. Called every second while silent, so the choice follows the page.
    banner.classList.toggle("cbnb-stale-on", on);
    const full = document.querySelector(".cbnb-stale-banner.cbnb-stale-on") === banner;
    if (on) banner.textContent = full ? `No word from the kernel for ${Math.round(secs)} s: it was restarted, shut `
      + "down or is stuck, so this panel is not live. Re-run the cell that made it."
      : "Not live: no word from the kernel (see the first panel).";
    if (on === stale) return;
    stale = on;
    banner.style.display = on ? "" : "none";
    root.classList.toggle("cbnb-stale", on);
  };
  const heard = () => { last = performance.now(); setStale(false, 0); };
  model.on("change:_beat", heard);
  model.on("change:_stamp", heard);
  const timer = setInterval(() => {
    if (!(model.get("_beat") > 0)) return;
    const secs = (performance.now() - last) / 1000;
    if (secs > CBNB_STALE_S) setStale(true, secs);
  }, 1000);
  const onClick = (e) => {
    if (!stale || banner.contains(e.target)) return;
    e.stopPropagation();
    e.preventDefault();
    banner.classList.remove("cbnb-flash");
    void banner.offsetWidth;  // restart the flash animation
    banner.classList.add("cbnb-flash");
  };
  root.addEventListener("click", onClick, true);
  return () => {
    clearInterval(timer);
    model.off("change:_beat", heard);
    model.off("change:_stamp", heard);
    root.removeEventListener("click", onClick, true);
  };
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

// ---------------------------------------------------------------------------------------------- presentation
// Colours follow JupyterLab's theme: body[data-jp-theme-light] says light or dark, and the --jp-* variables give
// the text and border colours. Canvas and plotly colours come from here; CSS uses the variables directly.
const CBNB_REASON_COLORS = {
  light: { token_budget: "#e45756", cache_budget: "#f58518", request_cap: "#b279a2", safety_margin: "#54a24b",
    no_free_blocks: "#4c78a8", stalled_ahead: "#9d755d", offload_backoff: "#d4a200", finishing: "#72b7b2" },
  dark: { token_budget: "#ff7b7b", cache_budget: "#ffa654", request_cap: "#d6a3ce", safety_margin: "#7fd07a",
    no_free_blocks: "#7fb0e8", stalled_ahead: "#c9a183", offload_backoff: "#f2d24b", finishing: "#8fd8d2" },
};
const CBNB_PALETTES = {
  light: { prefill: "#4c78a8", decode: "#72b7b2", decodeLine: "#1b7f79", blue: "#4c78a8", green: "#54a24b",
    orange: "#f58518", red: "#e45756", purple: "#b279a2", brown: "#9d755d", teal: "#72b7b2", grey: "#9a9a9a" },
  dark: { prefill: "#6f9fd8", decode: "#5fb7b0", decodeLine: "#8fe3dc", blue: "#7fb0e8", green: "#7fd07a",
    orange: "#ffa654", red: "#ff7b7b", purple: "#d6a3ce", brown: "#c9a183", teal: "#8fd8d2", grey: "#b0b0b0" },
};

function cbnbIsDark() {
  const light = document.body && document.body.dataset ? document.body.dataset.jpThemeLight : undefined;
  if (light === "true") return false;
  if (light === "false") return true;
  return !!(globalThis.matchMedia && globalThis.matchMedia("(prefers-color-scheme: dark)").matches);
}

function cbnbTheme(el) {
  const dark = cbnbIsDark();
  const cs = getComputedStyle(el || document.body);
  const v = (name, fallback) => (cs.getPropertyValue(name) || "").trim() || fallback;
  const key = dark ? "dark" : "light";
  const reasons = CBNB_REASON_COLORS[key];
  return {
    dark,
    fg: v("--jp-ui-font-color1", dark ? "#e0e0e0" : "#222222"),
    fg2: v("--jp-ui-font-color2", dark ? "#b8b8b8" : "#555555"),
    grid: v("--jp-border-color2", dark ? "#4a4a4a" : "#e0e0e0"),
    bg: v("--jp-layout-color1", dark ? "#111111" : "#ffffff"),
    veil: dark ? "rgba(20,20,20,0.55)" : "rgba(255,255,255,0.6)",
    pal: CBNB_PALETTES[key],
    reason: (r) => reasons[r] || (dark ? "#cccccc" : "#888888"),
  };
}

// The font scale of presentation mode (1x-2x), a CSS variable set on <html> by the dashboard's controls.
function cbnbScale(el) {
  const s = parseFloat(getComputedStyle(el || document.documentElement).getPropertyValue("--cbnb-scale"));
  return s > 0 ? s : 1;
}

// Call `fn` after a JupyterLab theme switch (once the new theme's variables apply) and after a font-scale change.
// Returns the function that stops listening.
function cbnbOnTheme(fn) {
  let t = null;
  const later = () => { if (t) clearTimeout(t); t = setTimeout(() => { t = null; fn(); }, 150); };
  const mo = typeof MutationObserver !== "undefined" ? new MutationObserver(later) : null;
  if (mo && document.body) {
    mo.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light", "data-jp-theme-name"] });
  }
  globalThis.addEventListener("cbnb:presentation", later);
  return () => { if (mo) mo.disconnect(); if (t) clearTimeout(t); globalThis.removeEventListener("cbnb:presentation", later); };
}
