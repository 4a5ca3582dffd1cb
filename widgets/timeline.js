// Request timeline: one row per request (arrival order, the newest at the bottom), one column per engine step.
// A cell is waiting (shaded by the skip reason), a prefill chunk (the whole cell, as its legend swatch; its
// tokens are in the hover), a decode, swapped out / waiting in swap, a soft reset, or the end. Drawn with ImageData on one canvas
// that shows only the rows in view, so 256 requests x 500 steps cost the same as 20. Hover asks Python for the
// cell's details; a click selects the row's request ("Why?").

const TL_KINDS = ["empty", "waiting", "prefill", "decode", "in_swap", "swapped_out", "soft_reset", "finished", "failed",
  "cancelled"];
const TL_LABELS = {
  waiting: "waiting (shade = reason)", prefill: "prefill chunk",
  decode: "decode", swapped_out: "swapped out to host", in_swap: "waiting in host swap", soft_reset: "soft reset",
  finished: "finished", failed: "failed", cancelled: "cancelled",
};
const TL_COLORS = {
  light: { prefill: "#3d6fa8", decode: "#1b8f87", swapped_out: "#8e44ad", in_swap: "#c9a3dc", soft_reset: "#8b1a1a",
    finished: "#3f9e3a", failed: "#d62728", cancelled: "#8a8a8a", empty: null },
  // Soft reset is raspberry, not a second red beside "failed" (tests/ui check every pair is far apart).
  dark: { prefill: "#6fa3e0", decode: "#4fd1c5", swapped_out: "#c17ce0", in_swap: "#6d4a7f", soft_reset: "#e0457b",
    finished: "#6fd06a", failed: "#ff6b6b", cancelled: "#9a9a9a", empty: null },
};

function tlRgb(css) {
  const m = /^#([0-9a-f]{6})$/i.exec(String(css).trim());
  if (m) { const n = parseInt(m[1], 16); return [(n >> 16) & 255, (n >> 8) & 255, n & 255]; }
  const r = /rgba?\(([^)]+)\)/.exec(String(css));
  if (r) { const p = r[1].split(",").map((x) => parseFloat(x)); return [p[0] | 0, p[1] | 0, p[2] | 0]; }
  return [255, 255, 255];
}
function tlMix(a, b, t) { return a.map((x, i) => Math.round(x * (1 - t) + b[i] * t)); }
function tlPack([r, g, b]) { return (255 << 24) | (b << 16) | (g << 8) | r; }

// Per code: its colour as packed RGBA. A prefill cell is filled whole, like its legend swatch (a pale cell with a
// sliver for a short chunk read as waiting); how many tokens it took is in the hover.
function tlPalette(theme, reasons) {
  const bg = tlRgb(theme.bg);
  const cols = TL_COLORS[theme.dark ? "dark" : "light"];
  const full = new Uint32Array(256);
  for (let v = 0; v < 256; v++) {
    const kind = TL_KINDS[v & 15] || "empty";
    let c = bg;
    if (kind === "waiting") c = tlMix(tlRgb(theme.reason(reasons[v >> 4])), bg, theme.dark ? 0.45 : 0.55);
    else if (kind !== "empty" && cols[kind]) c = tlRgb(cols[kind]);
    full[v] = tlPack(c);
  }
  return { full, bg: tlPack(bg) };
}

// `text` cut to `w` pixels with an ellipsis (row labels in the gutter).
function tlFit(ctx, text, w) {
  if (ctx.measureText(text).width <= w) return text;
  let lo = 0, hi = text.length;
  while (lo < hi) { const m = (lo + hi + 1) >> 1; if (ctx.measureText(text.slice(0, m) + "…").width <= w) lo = m; else hi = m - 1; }
  return text.slice(0, lo) + "…";
}

function initialize({ model }) {
  cbnbTrackLatency(model, "timeline");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-timeline", "Request timeline");
  const top = cbnbEl("div", "cbnb-row cbnb-tl-top");
  const info = cbnbEl("div", "cbnb-hint cbnb-tl-info");
  const viewLabel = cbnbEl("label", "cbnb-field cbnb-inline");
  const view = cbnbEl("select", "cbnb-tl-view");
  view.title = "How many of the newest steps the columns show (fewer: wider cells)";
  for (const n of [25, 50, 100, 250, 500]) { const o = cbnbEl("option", null, `last ${n} steps`); o.value = String(n); view.append(o); }
  viewLabel.append(cbnbEl("span", "cbnb-field-label", "show"), view);
  top.append(info, viewLabel);
  const legend = cbnbEl("div", "cbnb-legend cbnb-tl-legend");
  const wrap = cbnbEl("div", "cbnb-tl-wrap");
  const canvas = cbnbEl("canvas", "cbnb-tl-canvas");
  const spacer = cbnbEl("div", "cbnb-tl-spacer");
  wrap.append(canvas, spacer);
  const tip = cbnbEl("div", "cbnb-tooltip cbnb-tl-tooltip");
  tip.style.display = "none";
  f.body.append(top, legend, wrap, tip);
  f.root.style.position = "relative";
  let geo = null; // what the last draw laid out: rows, columns, sizes
  let hovered = null; // {row, col, seq, id, step, detail}
  let seq = 0;
  let follow = true; // keep the newest rows in view while the user has not scrolled up

  const drawLegend = (theme) => {
    const cols = TL_COLORS[theme.dark ? "dark" : "light"];
    const reasons = model.get("reasons") || [];
    const rinfo = model.get("reason_info") || {};
    const items = [];
    for (const k of ["prefill", "decode", "swapped_out", "in_swap", "soft_reset", "finished", "failed", "cancelled"]) {
      const it = cbnbEl("span", "cbnb-legend-item");
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = cols[k];
      it.dataset.kind = k;
      it.append(sw, cbnbEl("span", null, TL_LABELS[k]));
      items.push(it);
    }
    // Waiting shades: only the reasons that appear in the cells.
    const cells = cbnbBytes(model.get("cells"));
    const seen = new Set();
    for (let i = 0; i < cells.length; i++) if ((cells[i] & 15) === 1 || (cells[i] & 15) === 4) seen.add(cells[i] >> 4);
    const bg = tlRgb(theme.bg);
    for (const ri of [...seen].sort((a, b) => a - b)) {
      const r = reasons[ri];
      if (!r) continue;
      const it = cbnbEl("span", "cbnb-legend-item");
      const sw = cbnbEl("span", "cbnb-swatch");
      const c = tlMix(tlRgb(theme.reason(r)), bg, theme.dark ? 0.45 : 0.55);
      sw.style.background = `rgb(${c.join(",")})`;
      it.dataset.reason = r;
      it.title = (rinfo[r] || {}).meaning || "";
      it.append(sw, cbnbEl("span", null, `waiting: ${(rinfo[r] || {}).label || r}`));
      items.push(it);
    }
    legend.replaceChildren(...items);
  };

  const draw = () => {
    const t0 = performance.now();
    const rows = model.get("rows") || [];
    const ncols = model.get("num_steps") || 0;
    const first = model.get("first_step") || 0;
    const cells = cbnbBytes(model.get("cells"));
    const theme = cbnbTheme(f.root);
    const scale = cbnbScale(f.root);
    const reasons = model.get("reasons") || [];
    const pal = tlPalette(theme, reasons);
    const width = Math.max(320, wrap.clientWidth || el.clientWidth || 800);
    // The label gutter grows with the font only up to 240 px (and a fifth of the width): at 2x the step columns
    // keep their width instead of shrinking to ~5 px; long labels end in "…" (the hover names the request).
    const rowH = Math.round(14 * scale), headH = Math.round(18 * scale);
    const gutter = Math.round(Math.min(200 * scale, Math.max(200, Math.min(240, width * 0.2))));
    const maxH = Math.round(330 * scale);
    const total = headH + rows.length * rowH;
    const h = Math.max(headH + rowH, Math.min(maxH, total));
    wrap.style.height = `${h}px`;
    spacer.style.height = `${Math.max(0, total - h)}px`;
    if (canvas.width !== width || canvas.height !== h) { canvas.width = width; canvas.height = h; }
    const plotW = width - gutter - 4;
    // Columns: the newest `view_steps`, as wide as fits, 2..28 px (scaled); when they do not all fit, the newest.
    const want = Math.min(ncols, model.get("view_steps") || ncols);
    const colW = want ? Math.max(2, Math.min(28 * scale, plotW / want)) : 28 * scale;
    const shown = Math.min(want, Math.floor(plotW / colW));
    const col0 = ncols - shown; // first column drawn
    if (follow) wrap.scrollTop = Math.max(0, total - h);
    const top = wrap.scrollTop;
    const row0 = Math.floor(top / rowH);
    const nrows = Math.min(rows.length - row0, Math.ceil((h - headH) / rowH) + 1);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(width, h);
    const px = new Uint32Array(img.data.buffer);
    px.fill(pal.bg);
    // Per pixel column: which step column it shows (-1: a gap between columns, or none).
    const colGap = colW >= 5 ? 1 : 0, rowGap = rowH >= 6 ? 1 : 0;
    const xs = new Int32Array(width).fill(-1);
    for (let x = gutter; x < gutter + shown * colW && x < width; x++) {
      const u = (x - gutter) / colW, c = Math.floor(u);
      if (c >= shown || (colGap && (x - gutter) - c * colW >= colW - colGap)) continue;
      xs[x] = col0 + c;
    }
    const yOff = top - row0 * rowH; // pixels of row0 scrolled out at the top
    for (let y = headH; y < h; y++) {
      const v = y - headH + yOff, r = Math.floor(v / rowH), ri = row0 + r;
      if (ri >= rows.length || r < 0) break;
      if (rowGap && v - r * rowH >= rowH - rowGap) continue;
      const base = ri * ncols, line = y * width;
      for (let x = gutter; x < width; x++) {
        const c = xs[x];
        if (c < 0) continue;
        const code = cells[base + c] || 0;
        if (!code) continue;
        px[line + x] = pal.full[code];
      }
    }
    ctx.putImageData(img, 0, 0);
    // Header: step numbers every ~70 px; run markers as dashed lines.
    const fsz = Math.round(10 * scale);
    ctx.font = `${fsz}px ${getComputedStyle(f.root).fontFamily || "sans-serif"}`;
    ctx.fillStyle = theme.fg2;
    ctx.textBaseline = "middle";
    ctx.textAlign = "left";
    const every = [1, 2, 5, 10, 20, 50, 100, 200, 500].find((k) => k * colW >= 56) || 1000;
    for (let c = 0; c < shown; c++) {
      const s = first + col0 + c;
      if (s % every === 0 || (c === 0 && shown < every)) ctx.fillText(String(s), gutter + c * colW, headH / 2);
    }
    ctx.fillText("step →", 4, headH / 2);
    for (const r of model.get("runs") || []) {
      const c = r.step + 1 - first - col0;
      if (c <= 0 || c > shown) continue;
      const x = Math.round(gutter + c * colW) - 0.5;
      ctx.strokeStyle = theme.fg2; ctx.setLineDash([3, 3]); ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, h); ctx.stroke(); ctx.setLineDash([]);
    }
    // Row labels: id and the prompt's first words; the selected row outlined.
    const sel = model.get("selected") || "";
    ctx.font = `${Math.round(11 * scale)}px ${getComputedStyle(f.root).fontFamily || "sans-serif"}`;
    for (let r = 0; r < nrows; r++) {
      const row = rows[row0 + r];
      const y = headH + r * rowH - yOff;
      if (y + rowH <= headH) continue;
      ctx.save();
      ctx.beginPath(); ctx.rect(0, headH, gutter - 6, h - headH); ctx.clip();
      ctx.fillStyle = theme.fg;
      const state = row.state ? ` ${row.state === "FINISHED" ? "✓" : row.state === "CANCELLED" ? "✗" : ""}` : "";
      ctx.fillText(tlFit(ctx, `${row.id}${state} ${row.label || ""}`, gutter - 10), 4, y + rowH / 2);
      ctx.restore();
      if (row.id === sel) {
        ctx.strokeStyle = theme.dark ? "#ffe066" : "#111"; ctx.lineWidth = 1.5;
        ctx.strokeRect(1.5, Math.max(headH, y) + 0.5, width - 3, rowH - 1);
      }
    }
    info.textContent = ncols
      ? `steps ${first + col0}–${first + ncols - 1} · ${rows.length} request${rows.length === 1 ? "" : "s"}`
        + (col0 ? ` · ${col0} older steps not shown` : "")
        + (model.get("note") ? ` · ${model.get("note")}` : "")
        + " · hover a cell for its numbers; click a row for its story (Why?)"
      : "No steps yet: submit a prompt.";
    geo = { rows, ncols, first, col0, shown, colW, rowH, headH, gutter, row0, yOff, h, width };
    f.root.__cbnbGeo = { ...geo, rows: rows.map((r) => r.id) }; // read by the browser tests
    drawLegend(theme);
    (f.root.__cbnbDrawMs = f.root.__cbnbDrawMs || []).push(performance.now() - t0);
    if (f.root.__cbnbDrawMs.length > 200) f.root.__cbnbDrawMs.splice(0, 100);
    cbnbRecordRender(model, "timeline");
    if (hovered) showTip();
  };

  const at = (e) => {
    if (!geo) return null;
    const r = canvas.getBoundingClientRect();
    const x = e.clientX - r.left, y = e.clientY - r.top;
    if (y < geo.headH) return null;
    const ri = geo.row0 + Math.floor((y - geo.headH + geo.yOff) / geo.rowH);
    if (ri < 0 || ri >= geo.rows.length) return null;
    const c = x >= geo.gutter ? Math.floor((x - geo.gutter) / geo.colW) : -1;
    const col = c >= 0 && c < geo.shown ? geo.col0 + c : -1;
    return { row: ri, col, id: geo.rows[ri].id, step: col >= 0 ? geo.first + col : null, x, y };
  };
  const showTip = () => {
    if (!hovered) return;
    const cells = cbnbBytes(model.get("cells"));
    const code = hovered.col >= 0 ? cells[hovered.row * (geo ? geo.ncols : 0) + hovered.col] || 0 : 0;
    const kind = TL_KINDS[code & 15] || "empty";
    const head = hovered.step === null ? `${hovered.id}: click for its story`
      : `${hovered.id} · step ${hovered.step} · ${kind === "empty" ? "not in the engine" : kind.replace("_", " ")}`;
    tip.textContent = head + (hovered.detail ? `\n${hovered.detail}` : "");
    if (tip.style.display !== "none") place();
  };
  // Beside the pointer, kept inside the panel (to its left near the right edge).
  let lastPointer = null;
  const place = (e) => {
    if (e) lastPointer = { x: e.clientX, y: e.clientY };
    if (!lastPointer) return;
    const box = f.root.getBoundingClientRect();
    tip.style.display = "";
    const w = tip.offsetWidth, x = lastPointer.x - box.left;
    tip.style.left = `${x + 12 + w <= box.width ? x + 12 : Math.max(0, x - 12 - w)}px`;
    tip.style.top = `${lastPointer.y - box.top + 14}px`;
  };
  const onMove = (e) => {
    const a = at(e);
    if (!a) { tip.style.display = "none"; hovered = null; return; }
    place(e);
    if (hovered && hovered.row === a.row && hovered.col === a.col) return;
    if (!hovered || hovered.id !== a.id) model.send({ kind: "hover_request", id: a.id });
    hovered = { ...a, seq: ++seq, detail: "" };
    showTip();
    if (a.step !== null) model.send({ kind: "hover", id: a.id, step: a.step, seq: hovered.seq });
  };
  const onMsg = (msg) => {
    if (!msg || msg.kind !== "hover" || !hovered || msg.seq !== hovered.seq) return;
    if (msg.error) hovered.detail = msg.error;
    else {
      const lines = [];
      if (msg.phase) lines.push(`${msg.phase}: ${msg.tokens} tokens (positions ${msg.start}-${msg.start + msg.tokens - 1})`
        + ` of the step's ${msg.token_budget}` + (msg.prefix_hit_tokens ? ` · prefix hit ${msg.prefix_hit_tokens} tokens` : ""));
      if (msg.reason) lines.push(`left out: ${msg.reason_label}: ${msg.meaning}` + (msg.numbers ? ` (${msg.numbers})` : "")
        + (msg.fields && msg.fields.length ? `\n  change: ${msg.fields.join(", ")}` : ""));
      if (msg.offload) lines.push(`${msg.offload === "swap" ? "swapped out" : "soft reset"}: ${msg.offload_reason}`
        + (msg.tokens_to_recompute ? ` · ${msg.tokens_to_recompute} tokens to recompute` : ""));
      if (msg.restored_blocks) lines.push(`restored ${msg.restored_blocks} blocks from the host pool`);
      lines.push(`blocks held: ${msg.blocks}`);
      hovered.detail = lines.join("\n");
    }
    showTip();
  };
  const onLeave = () => {
    tip.style.display = "none";
    if (hovered) model.send({ kind: "hover_request", id: null });
    hovered = null;
  };
  const onClick = (e) => { const a = at(e); if (a) model.send({ kind: "select", id: a.id }); };
  view.value = String(model.get("view_steps") || 100);
  view.addEventListener("change", () => { model.set("view_steps", Number(view.value)); model.save_changes(); schedule(); });
  canvas.addEventListener("mousemove", onMove);
  canvas.addEventListener("mouseleave", onLeave);
  canvas.addEventListener("click", onClick);
  const schedule = cbnbOnFrame(draw);
  wrap.addEventListener("scroll", () => {
    follow = wrap.scrollTop + wrap.clientHeight >= wrap.scrollHeight - 2;
    schedule();
  });
  model.on("msg:custom", onMsg);
  const names = ["rows", "cells", "num_steps", "first_step", "runs", "selected", "reasons", "view_steps", "note"];
  for (const n of names) model.on(`change:${n}`, schedule);
  const offTheme = cbnbOnTheme(draw);
  let ro = null;
  if (typeof ResizeObserver !== "undefined") {
    let lastW = 0;
    ro = new ResizeObserver(() => { const w = wrap.clientWidth; if (w && Math.abs(w - lastW) > 8) { lastW = w; schedule(); } });
    ro.observe(wrap);
  }
  requestAnimationFrame(draw);
  return () => {
    f.cleanup();
    offTheme();
    if (ro) ro.disconnect();
    model.off("msg:custom", onMsg);
    for (const n of names) model.off(`change:${n}`, schedule);
  };
}

export default { initialize, render };
