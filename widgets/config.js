// Config panel: one control per ContinuousBatchingConfig field with a one-line explanation, a memory preview
// (current vs proposed), the config as transformers code, and Apply / Reset.

const MEM_PARTS = [
  ["weights", "weights", "#9d755d"], ["kv_cache", "KV cache", "#4c78a8"],
  ["activations", "activations", "#f58518"], ["logits", "logits", "#e45756"], ["cuda_graphs", "CUDA graphs", "#72b7b2"],
  ["swap_pool", "host swap", "#bab0ac"],
];

function cfgFormat(f, v) {
  if (typeof v === "boolean") return v ? "on" : "off";
  if (f.unit === "fraction") return Number(v).toFixed(2);
  if (f.unit === "GiB") return `${Number(v).toFixed(2)} GiB`;
  if (typeof v === "number") return v.toLocaleString();
  return String(v);
}

function initialize({ model }) {
  cbnbTrackLatency(model, "config");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-config", "Config");
  const form = cbnbEl("div", "cbnb-config-form");
  const mem = cbnbEl("div", "cbnb-memory");
  const memText = cbnbEl("div", "cbnb-hint cbnb-memory-text");
  const memErr = cbnbEl("div", "cbnb-message cbnb-msg-error cbnb-memory-error");
  const buttons = cbnbEl("div", "cbnb-row");
  const apply = cbnbEl("button", "cbnb-btn cbnb-primary cbnb-apply", "Apply");
  apply.title = "Reconfigure the engine once no request is unfinished (queued requests finish first: nothing is lost)";
  const reset = cbnbEl("button", "cbnb-btn cbnb-reset", "Reset");
  reset.title = "Discard the edits";
  const changed = cbnbEl("span", "cbnb-hint cbnb-changed");
  buttons.append(apply, reset, changed);
  const codeHead = cbnbEl("div", "cbnb-row");
  const copy = cbnbEl("button", "cbnb-btn cbnb-small cbnb-copy", "Copy");
  codeHead.append(cbnbEl("span", "cbnb-subtitle", "transformers code"), copy);
  const code = cbnbEl("pre", "cbnb-code");
  f.body.append(form, cbnbEl("div", "cbnb-subtitle", "Memory: current vs proposed"), mem, memText, memErr, buttons, codeHead, code);

  const controls = {}; // name -> {input, out, row, field}
  let local = { ...(model.get("values") || {}) };

  const push = (name, value) => {
    local = { ...model.get("values"), [name]: value };
    model.set("values", local);
    model.save_changes();
    refresh();
  };

  const build = () => {
    form.replaceChildren();
    for (const fd of model.get("fields") || []) {
      const row = cbnbEl("div", "cbnb-config-row");
      row.dataset.field = fd.name;
      const label = cbnbEl("label", "cbnb-config-label", fd.name);
      const out = cbnbEl("span", "cbnb-config-value");
      let input;
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
          l.append(r, cbnbEl("span", null, o));
          input.append(l);
        }
      } else if (fd.kind === "toggle") {
        input = cbnbEl("input");
        input.type = "checkbox";
        input.addEventListener("change", () => push(fd.name, input.checked));
      } else {
        input = cbnbEl("input");
        input.type = "range";
        input.min = fd.min; input.max = fd.max; input.step = fd.step;
        input.addEventListener("input", () => push(fd.name, Number(input.value)));
      }
      input.classList.add("cbnb-config-input");
      input.dataset.field = fd.name;
      const help = cbnbEl("div", "cbnb-config-help", fd.help);
      row.append(label, input, out, help);
      form.append(row);
      controls[fd.name] = { input, out, row, field: fd };
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
      else if (document.activeElement !== c.input || fd.kind === "select") c.input.value = String(v);
      const diff = applied[name] !== undefined && applied[name] !== v;
      if (diff) nChanged++;
      c.out.textContent = cfgFormat(fd, v) + (diff ? ` (now ${cfgFormat(fd, applied[name])})` : "");
      c.row.classList.toggle("cbnb-changed-row", diff);
      const off = (name === "num_blocks" && vals.sizing !== "num_blocks")
        || (name === "max_memory_percent" && vals.sizing === "num_blocks")
        || ((name === "use_cuda_graph" || name === "use_async_batching") && device !== "cuda");
      c.row.classList.toggle("cbnb-inactive", off);
    }
    changed.textContent = nChanged ? `${nChanged} change${nChanged > 1 ? "s" : ""} not applied yet` : "no pending changes";
    const busy = !!model.get("busy");
    const m = model.get("memory") || {};
    apply.disabled = busy || !!m.error;
    apply.textContent = busy ? "Applying…" : "Apply";
    code.textContent = model.get("code") || "";
    drawMemory(m);
  };

  const drawMemory = (m) => {
    const cur = m.current || {}, prop = m.proposed || {};
    const total = (s) => MEM_PARTS.reduce((a, [k]) => a + (s[k] || 0), 0);
    const max = Math.max(total(cur), total(prop), 1);
    const bar = (label, s) => {
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
      row.append(track, cbnbEl("span", "cbnb-mem-total", cbnbBytesText(total(s))));
      return row;
    };
    const legend = cbnbEl("div", "cbnb-legend");
    for (const [k, name, color] of MEM_PARTS) {
      if (!cur[k] && !prop[k]) continue;
      const it = cbnbEl("span", "cbnb-legend-item");
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = color;
      it.append(sw, cbnbEl("span", null, `${name} ${cbnbBytesText(cur[k] || 0)} → ${cbnbBytesText(prop[k] || 0)}`));
      legend.append(it);
    }
    mem.replaceChildren(bar("current", cur), bar("proposed", m.error ? {} : prop), legend);
    memText.textContent = m.text || "";
    memErr.textContent = m.error || "";
    memErr.style.display = m.error ? "" : "none";
  };

  copy.addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(code.textContent); copy.textContent = "Copied"; }
    catch (e) { copy.textContent = "Select the text to copy"; }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  apply.addEventListener("click", () => model.send({ kind: "apply", values: model.get("values") }));
  reset.addEventListener("click", () => model.send({ kind: "reset" }));

  const names = ["values", "applied", "memory", "code", "busy", "device"];
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
