// Config panel: one control per ContinuousBatchingConfig field in two columns (cache | scheduling; the CUDA-only
// fields folded away on CPU; each field's explanation as its tooltip; rows wrap rather than overlap at 2x fonts;
// numeric fields have a slider and a number box for exact values), a memory preview (current vs
// proposed), the config as transformers code, and a sticky Apply / Reset bar with the result next to it.

const MEM_PARTS = [
  ["weights", "weights", "#9d755d"], ["packed_weights", "packed weights (CPU)", "#c9a183"],
  ["kv_cache", "KV cache", "#4c78a8"],
  ["activations", "activations", "#f58518"], ["logits", "logits", "#e45756"], ["cuda_graphs", "CUDA graphs", "#72b7b2"],
  ["swap_pool", "host swap", "#bab0ac"],
];
const CFG_APPLY_TIP = "Reconfigure the engine now, also mid-run: unfinished requests are kept and their KV is "
  + "recomputed in the new cache (swapped-out ones too); the plots start a new run at this step";

function cfgFormat(f, v) {
  if (typeof v === "boolean") return v ? "on" : "off";
  if (f.unit === "fraction") return Number(v).toFixed(2);
  if (f.unit === "GiB") return `${Number(v).toFixed(2)} GiB`;
  if (typeof v === "number") return v.toLocaleString();
  return String(v);
}

// Numeric fields: a slider (log-scaled where the range spans decades, so 16-4096 is not 4 px per step) next to a
// number box for exact values. The slider runs over CFG_TICKS positions; its value is mapped to the field's.
const CFG_TICKS = 1000;
function cfgIsLog(fd) { return fd.min > 0 && fd.max / fd.min >= 50; }
function cfgIsInt(fd) { return Number.isInteger(Number(fd.step)) && Number.isInteger(Number(fd.min)); }
function cfgFromTick(fd, t) {
  const lo = Number(fd.min), hi = Number(fd.max), step = Number(fd.step) || 1;
  const raw = cfgIsLog(fd) ? lo * Math.pow(hi / lo, t / CFG_TICKS) : lo + (hi - lo) * (t / CFG_TICKS);
  // Snap to the field's step (counted from 0, so 16-4096 by 16 gives 16, 32, ...), inside the range.
  const snapped = Math.round(raw / step) * step;
  const v = Math.min(hi, Math.max(lo, snapped));
  return cfgIsInt(fd) ? Math.round(v) : Number(v.toFixed(6));
}
function cfgToTick(fd, v) {
  const lo = Number(fd.min), hi = Number(fd.max), x = Math.min(hi, Math.max(lo, Number(v)));
  if (hi <= lo) return 0;
  return Math.round(CFG_TICKS * (cfgIsLog(fd) ? Math.log(x / lo) / Math.log(hi / lo) : (x - lo) / (hi - lo)));
}
// A typed value: the number, or {error} naming the field and its allowed range.
function cfgParse(fd, text) {
  const range = `${cfgFormat(fd, Number(fd.min))} to ${cfgFormat(fd, Number(fd.max))}`;
  const t = String(text).trim().replace(/,/g, "");
  const v = t === "" ? NaN : Number(t);
  if (!Number.isFinite(v)) return { error: `${fd.name} must be a number from ${range}; got "${text}"` };
  if (cfgIsInt(fd) && !Number.isInteger(v)) return { error: `${fd.name} must be a whole number from ${range}; got ${t}` };
  if (v < Number(fd.min) || v > Number(fd.max)) return { error: `${fd.name} must be from ${range}; got ${t}` };
  return { value: v };
}

function initialize({ model }) {
  cbnbTrackLatency(model, "config");
}

// The code box wraps a long line between words and after the dots of a dotted name
// ("transformers.generation.configuration_utils": <wbr>, which adds nothing to the copied text), so it never scrolls
// sideways beside the file browser or at 2x.
function cfgSetCode(pre, text) {
  if (pre.textContent === text) return;
  pre.replaceChildren();
  for (const part of text.split(/(?<=\.)/)) pre.append(document.createTextNode(part), document.createElement("wbr"));
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-config", "Config");
  const cols = cbnbEl("div", "cbnb-config-cols");
  const colCache = cbnbEl("div", "cbnb-config-col");
  const colSched = cbnbEl("div", "cbnb-config-col");
  const cacheHead = cbnbEl("div", "cbnb-row cbnb-config-colhead");
  const lockLabel = cbnbEl("label", "cbnb-lock");
  const lock = cbnbEl("input", "cbnb-lock-bytes");
  lock.type = "checkbox";
  lockLabel.title = "Changing page_size rescales num_blocks so that the cache keeps its bytes "
    + "(num_blocks x page_size stays the same)";
  lockLabel.append(lock, cbnbEl("span", null, "keep cache bytes fixed"));
  cacheHead.append(cbnbEl("span", "cbnb-subtitle", "KV cache"), lockLabel);
  const formCache = cbnbEl("div", "cbnb-config-form");
  colCache.append(cacheHead, formCache);
  const formSched = cbnbEl("div", "cbnb-config-form");
  const cuda = cbnbEl("details", "cbnb-cuda-fields");
  const cudaSum = cbnbEl("summary", "cbnb-subtitle");
  const formCuda = cbnbEl("div", "cbnb-config-form");
  cuda.append(cudaSum, formCuda);
  colSched.append(cbnbEl("div", "cbnb-subtitle cbnb-config-colhead", "Scheduling"), formSched, cuda);
  cols.append(colCache, colSched);

  const mem = cbnbEl("div", "cbnb-memory");
  const memText = cbnbEl("div", "cbnb-hint cbnb-memory-text");
  const memErr = cbnbEl("div", "cbnb-message cbnb-msg-error cbnb-memory-error");
  const codeHead = cbnbEl("div", "cbnb-row");
  const copy = cbnbEl("button", "cbnb-btn cbnb-small cbnb-copy", "Copy");
  codeHead.append(cbnbEl("span", "cbnb-subtitle", "transformers code"), copy);
  const code = cbnbEl("pre", "cbnb-code");
  // The bar sticks to the bottom of the notebook's view while the panel is taller than it; the panel's message
  // line (Apply's result) sits in it, next to the buttons.
  const bar = cbnbEl("div", "cbnb-apply-bar");
  const apply = cbnbEl("button", "cbnb-btn cbnb-primary cbnb-apply", "Apply");
  apply.title = CFG_APPLY_TIP;
  const reset = cbnbEl("button", "cbnb-btn cbnb-reset", "Reset");
  reset.title = "Discard the edits";
  const changed = cbnbEl("span", "cbnb-hint cbnb-changed");
  bar.append(apply, reset, changed, f.msg);
  const bottom = cbnbEl("div", "cbnb-config-bottom");
  const memBox = cbnbEl("div");
  memBox.append(cbnbEl("div", "cbnb-subtitle", "Memory: current vs proposed"), mem, memText, memErr);
  const codeBox = cbnbEl("div");
  codeBox.append(codeHead, code);
  bottom.append(memBox, codeBox);
  f.body.append(cols, bottom, bar);

  const controls = {}; // name -> {input, out, row, field}

  const push = (name, value) => {
    model.set("values", { ...model.get("values"), [name]: value });
    model.save_changes();
    refresh();
  };
  // A typed value that is not valid stays in its box, marked, with the reason under the row; nothing is sent.
  const showError = (name, text) => {
    const c = controls[name];
    if (!c) return;
    c.err.textContent = text;
    c.err.style.display = "";
    if (c.num) c.num.setAttribute("aria-invalid", "true");
    c.row.classList.add("cbnb-invalid-row");
  };
  const clearError = (name) => {
    const c = controls[name];
    if (!c) return;
    c.err.textContent = "";
    c.err.style.display = "none";
    if (c.num) c.num.removeAttribute("aria-invalid");
    c.row.classList.remove("cbnb-invalid-row");
  };

  const build = () => {
    for (const form of [formCache, formSched, formCuda]) form.replaceChildren();
    for (const fd of model.get("fields") || []) {
      const row = cbnbEl("div", "cbnb-config-row");
      row.dataset.field = fd.name;
      const label = cbnbEl("label", "cbnb-config-label", fd.name);
      const out = cbnbEl("span", "cbnb-config-value");
      let input, num = null;
      if (fd.kind === "select") {
        input = cbnbEl("select");
        for (const o of fd.options) { const op = cbnbEl("option", null, o); op.value = String(o); input.append(op); }
        input.addEventListener("change", () => push(fd.name, typeof fd.options[0] === "number" ? Number(input.value) : input.value));
      } else if (fd.kind === "radio") {
        input = cbnbEl("span", "cbnb-radio");
        for (const o of fd.options) {
          const l = cbnbEl("label");
          const r = cbnbEl("input");
          r.type = "radio"; r.name = `cbnb-${fd.name}-${Math.random().toString(36).slice(2)}`; r.value = o;
          r.dataset.option = o;
          r.addEventListener("change", () => { if (r.checked) push(fd.name, o); });
          l.append(r, cbnbEl("span", null, o === "max_memory_percent" ? "memory %" : "blocks"));
          l.title = o;
          input.append(l);
        }
      } else if (fd.kind === "toggle") {
        input = cbnbEl("input");
        input.type = "checkbox";
        input.addEventListener("change", () => push(fd.name, input.checked));
      } else {
        input = cbnbEl("input");
        input.type = "range";
        input.min = "0"; input.max = String(CFG_TICKS); input.step = "1";
        input.addEventListener("input", () => { clearError(fd.name); push(fd.name, cfgFromTick(fd, Number(input.value))); });
        // Arrow keys move by the field's own step (PageUp/PageDown: x2 / /2), whatever the slider's scale.
        input.addEventListener("keydown", (e) => {
          const cur = Number((model.get("values") || {})[fd.name]), step = Number(fd.step) || 1;
          const next = { ArrowRight: cur + step, ArrowUp: cur + step, ArrowLeft: cur - step, ArrowDown: cur - step,
            PageUp: cur * 2, PageDown: cur / 2, Home: Number(fd.min), End: Number(fd.max) }[e.key];
          if (next === undefined || !Number.isFinite(cur)) return;
          e.preventDefault();
          const v = Math.min(Number(fd.max), Math.max(Number(fd.min), cfgIsInt(fd) ? Math.round(next) : Number(next.toFixed(6))));
          clearError(fd.name);
          push(fd.name, v);
        });
        num = cbnbEl("input", "cbnb-config-num");
        num.type = "text"; // not type=number: the browser would silently drop an invalid entry instead of our error
        num.inputMode = cfgIsInt(fd) ? "numeric" : "decimal";
        num.dataset.field = fd.name;
        num.setAttribute("aria-label", `${fd.name} (${cfgFormat(fd, Number(fd.min))} to ${cfgFormat(fd, Number(fd.max))})`);
        const commit = () => {
          const r = cfgParse(fd, num.value);
          if (r.error) { showError(fd.name, r.error); return; }
          clearError(fd.name);
          push(fd.name, r.value);
        };
        num.addEventListener("change", commit);
        num.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); commit(); } });
      }
      input.classList.add("cbnb-config-input");
      input.dataset.field = fd.name;
      const err = cbnbEl("div", "cbnb-config-error");
      err.style.display = "none";
      // The field's explanation is its tooltip.
      const unit = fd.unit && fd.unit !== "fraction" ? ` (${fd.unit})` : "";
      for (const cell of [row, label, input, out]) cell.title = `${fd.name}${unit}: ${fd.help || ""}`;
      const ctl = cbnbEl("span", "cbnb-config-ctl");
      ctl.append(input);
      if (num) ctl.append(num);
      row.append(label, ctl, out, err);
      (fd.cuda_only ? formCuda : fd.group === "scheduling" ? formSched : formCache).append(row);
      controls[fd.name] = { input, num, out, row, err, field: fd };
    }
    refresh();
  };

  const refresh = () => {
    const vals = model.get("values") || {};
    const applied = model.get("applied") || {};
    const device = model.get("device") || "cpu";
    let nChanged = 0;
    for (const [name, c] of Object.entries(controls)) {
      const v = vals[name];
      const fd = c.field;
      if (fd.kind === "toggle") c.input.checked = !!v;
      else if (fd.kind === "radio") c.input.querySelectorAll("input").forEach((r) => { r.checked = r.value === v; });
      else if (fd.kind === "range") {
        if (document.activeElement !== c.input) c.input.value = String(cfgToTick(fd, v));
        // The box keeps what is being typed (and an invalid entry) until it is committed.
        if (document.activeElement !== c.num && !c.row.classList.contains("cbnb-invalid-row")) c.num.value = String(v);
      } else if (document.activeElement !== c.input || fd.kind === "select") c.input.value = String(v);
      const diff = applied[name] !== undefined && applied[name] !== v;
      if (diff) nChanged++;
      // The control shows the value (numbers in their box; the unit is in the tooltip): the text only says the
      // value in force while an edit is pending.
      c.out.textContent = diff ? `(now ${cfgFormat(fd, applied[name])})` : "";
      c.out.style.display = c.out.textContent ? "" : "none";
      // toggle() with a second argument that is undefined flips the class: always pass a boolean.
      c.row.classList.toggle("cbnb-changed-row", !!diff);
      const off = (name === "num_blocks" && vals.sizing !== "num_blocks")
        || (name === "max_memory_percent" && vals.sizing === "num_blocks")
        || (!!fd.cuda_only && device !== "cuda");
      c.row.classList.toggle("cbnb-inactive", !!off);
    }
    cudaSum.textContent = device === "cuda" ? "CUDA graphs and padding" : `CUDA-only fields (no effect on ${device})`;
    if (device === "cuda" && !cuda.dataset.touched) cuda.open = true;
    lock.checked = !!model.get("lock_bytes");
    changed.textContent = nChanged ? `${nChanged} change${nChanged > 1 ? "s" : ""} not applied yet` : "no pending changes";
    const busy = !!model.get("busy");
    const m = model.get("memory") || {};
    apply.disabled = busy || !!m.error;
    apply.textContent = busy ? "Applying…" : "Apply";
    const text = model.get("code") || "";
    code.classList.toggle("cbnb-code-invalid", !!m.error);
    // While an edit is invalid there is no code for it: never show the code of older values.
    cfgSetCode(code, m.error ? `# not valid yet: ${m.error}\n# (the code appears once the values are valid)` : text);
    drawMemory(m);
  };

  const drawMemory = (m) => {
    const cur = m.current || {}, prop = m.error ? {} : (m.proposed || {});
    const total = (s) => MEM_PARTS.reduce((a, [k]) => a + (s[k] || 0), 0);
    const max = Math.max(total(cur), total(prop), 1);
    const bar = (label, s, note) => {
      const row = cbnbEl("div", "cbnb-mem-row");
      row.append(cbnbEl("span", "cbnb-mem-label", label));
      const track = cbnbEl("div", "cbnb-mem-track");
      for (const [k, name, color] of MEM_PARTS) {
        if (!s[k]) continue;
        const seg = cbnbEl("div", "cbnb-mem-seg");
        seg.style.width = `${(100 * s[k]) / max}%`;
        seg.style.background = color;
        seg.title = `${name}: ${cbnbBytesText(s[k])}`;
        seg.dataset.part = k;
        track.append(seg);
      }
      if (note) track.append(cbnbEl("span", "cbnb-mem-note", note));
      row.append(track, cbnbEl("span", "cbnb-mem-total", note ? "–" : cbnbBytesText(total(s))));
      return row;
    };
    const legend = cbnbEl("div", "cbnb-legend");
    for (const [k, name, color] of MEM_PARTS) {
      if (!cur[k] && !prop[k]) continue;
      const it = cbnbEl("span", "cbnb-legend-item");
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = color;
      // An invalid edit has no proposed split: "→ ?" rather than a false "→ 0 B".
      const to = m.error ? "?" : cbnbBytesText(prop[k] || 0);
      it.append(sw, cbnbEl("span", null, `${name} ${cbnbBytesText(cur[k] || 0)} → ${to}`));
      legend.append(it);
    }
    mem.replaceChildren(bar("current", cur), bar("proposed", prop, m.error ? "not valid" : ""), legend);
    memText.textContent = m.error ? "" : (m.text || "");
    memErr.textContent = m.error || "";
    memErr.style.display = m.error ? "" : "none";
  };

  copy.addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(code.textContent); copy.textContent = "Copied"; }
    catch (e) { copy.textContent = "Select the text to copy"; }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  cuda.addEventListener("toggle", () => { cuda.dataset.touched = "1"; });
  lock.addEventListener("change", () => { model.set("lock_bytes", lock.checked); model.save_changes(); });
  apply.addEventListener("click", () => model.send({ kind: "apply", values: model.get("values") }));
  reset.addEventListener("click", () => model.send({ kind: "reset" }));

  const names = ["values", "applied", "memory", "code", "busy", "device", "lock_bytes"];
  const schedule = cbnbOnFrame(refresh);
  for (const n of names) model.on(`change:${n}`, schedule);
  model.on("change:fields", build);
  build();
  return () => {
    f.cleanup();
    for (const n of names) model.off(`change:${n}`, schedule);
    model.off("change:fields", build);
  };
}

export default { initialize, render };
