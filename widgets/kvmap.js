// KV page map: every block of every layer group as a cell on a canvas (ImageData, so 100k blocks draw in a few
// ms). One byte per block: state code in bits 0-2, min(refcount, 31) in bits 3-7. Hover asks Python for owners and
// highlights all blocks of the block's owner (or of a request hovered / selected in another panel: `highlight`);
// a click selects the owner ("Why?"). Colours follow JupyterLab's light / dark theme.

const KV_STATES = ["free", "allocated", "shared", "cached", "reserved", "other_group"];
const KV_LABELS = {
  free: "free", allocated: "allocated (1 request)", shared: "shared (refcount ≥ 2)",
  cached: "cached prefix (no owner)", reserved: "reserved padding", other_group: "other layer group",
};
// [r, g, b] per state and theme; allocated/shared hues depend on the attention type.
const KV_BASES = {
  light: { free: [226, 228, 232], cached: [242, 169, 59], reserved: [60, 60, 60], other_group: [250, 250, 250] },
  // free: light enough to read against JupyterLab's near-black background at a projector's contrast
  dark: { free: [98, 104, 114], cached: [226, 150, 40], reserved: [185, 185, 185], other_group: [30, 30, 30] },
};
const KV_HUES = {
  full_attention: { allocated: [76, 120, 168], shared: [123, 50, 148] },
  sliding_attention: { allocated: [89, 161, 79], shared: [0, 128, 128] },
};
const KV_HUES_DARK = {
  full_attention: { allocated: [104, 153, 214], shared: [178, 110, 206] },
  sliding_attention: { allocated: [120, 196, 110], shared: [60, 180, 180] },
};
let KV_BASE = KV_BASES.light;

function kvHue(attn, dark) {
  const hues = dark ? KV_HUES_DARK : KV_HUES;
  return hues[attn] || hues.full_attention;
}

// `dim` (0..1): mixed with `bg` by that share (the blocks outside a highlight).
function kvPalette(attn, dark, dim = 0, bg = [255, 255, 255]) {
  const hue = kvHue(attn, dark);
  const base = dark ? KV_BASES.dark : KV_BASES.light;
  const pal = new Uint32Array(256);
  const pack = ([r, g, b]) => (255 << 24) | (b << 16) | (g << 8) | r; // little-endian RGBA
  for (let v = 0; v < 256; v++) {
    const st = KV_STATES[v & 7] || "free";
    const rc = v >> 3;
    let c = base[st] || hue[st] || [255, 0, 255];
    if (st === "allocated") c = hue.allocated;
    if (st === "shared") {
      const k = Math.min(1, (rc - 2) / 6); // darker (lighter in dark mode) with more sharers
      c = hue.shared.map((x) => Math.round(dark ? x + (255 - x) * 0.35 * k : x * (1 - 0.45 * k)));
    }
    if (dim) c = c.map((x, i) => Math.round(x * (1 - dim) + bg[i] * dim));
    pal[v] = pack(c);
  }
  return pal;
}

function kvCss([r, g, b]) { return `rgb(${r},${g},${b})`; }

function initialize({ model }) {
  cbnbTrackLatency(model, "kvmap");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-kvmap", "KV page map");
  const legend = cbnbEl("div", "cbnb-legend");
  const hlLine = cbnbEl("div", "cbnb-hint cbnb-kv-highlight");
  const grids = cbnbEl("div", "cbnb-kv-grids");
  const tip = cbnbEl("div", "cbnb-kv-tooltip");
  tip.style.display = "none";
  f.body.append(legend, hlLine, grids, tip);
  f.root.style.position = "relative";
  const viewId = Math.random().toString(36).slice(2);
  let seq = 0;
  let hovered = null; // {group, block, seq}
  let layouts = []; // per group: {canvas, cell, cols, n, meta}

  const drawLegend = (groups, dark) => {
    const tot = {};
    for (const g of groups) for (const [k, v] of Object.entries(g.counts || {})) tot[k] = (tot[k] || 0) + v;
    const attn = groups.length ? groups[0].attention_type : "full_attention";
    const hue = kvHue(attn, dark);
    const items = KV_STATES.filter((s) => s !== "other_group" || tot[s]).map((s) => {
      const it = cbnbEl("span", "cbnb-legend-item");
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = kvCss(KV_BASE[s] || hue[s]);
      it.append(sw, cbnbEl("span", null, `${KV_LABELS[s]}: ${(tot[s] || 0).toLocaleString()}`));
      it.dataset.state = s;
      return it;
    });
    legend.replaceChildren(...items);
  };

  const drawHighlight = (hl) => {
    if (!hl || !hl.request_id) { hlLine.textContent = "Hover a block to light up all blocks of its request; click it for the request's story."; return; }
    const co = Object.entries(hl.co_owners || {});
    const shared = (hl.shared || []).reduce((a, b) => a + b.length, 0);
    hlLine.textContent = `${hl.mode === "hover" ? "pointing at" : "selected"}: ${hl.request_id} · ${hl.count} block${hl.count === 1 ? "" : "s"}`
      + (shared ? ` · ${shared} shared with ${co.map(([r, n]) => `${r} (${n})`).join(", ")}` : "")
      + (hl.count ? "" : " (it holds no block now)");
  };

  const draw = () => {
    const groups = model.get("groups") || [];
    const cells = cbnbBytes(model.get("cells"));
    const theme = cbnbTheme(f.root);
    const dark = theme.dark;
    KV_BASE = dark ? KV_BASES.dark : KV_BASES.light;
    const hl = model.get("highlight") || {};
    drawHighlight(hl);
    drawLegend(groups, dark);
    const width = Math.max(240, (grids.clientWidth || el.clientWidth || 560) - 4);
    if (layouts.length !== groups.length) {
      grids.replaceChildren();
      layouts = groups.map(() => {
        const box = cbnbEl("div", "cbnb-kv-group");
        const title = cbnbEl("div", "cbnb-kv-group-title");
        const canvas = cbnbEl("canvas", "cbnb-kv-canvas");
        box.append(title, canvas);
        grids.append(box);
        return { box, title, canvas };
      });
    }
    groups.forEach((g, gi) => {
      const L = layouts[gi];
      const n = g.num_blocks;
      // Cell size: as large as fits about 360 px of height, 2..14 px; 1 px gaps from 6 px up.
      let cell = Math.floor(Math.sqrt((width * 360) / Math.max(1, n)));
      cell = Math.max(2, Math.min(14, cell));
      const cols = Math.max(1, Math.floor(width / cell));
      const rows = Math.ceil(n / cols);
      const w = cols * cell, h = rows * cell;
      if (L.canvas.width !== w || L.canvas.height !== h) { L.canvas.width = w; L.canvas.height = h; }
      L.cell = cell; L.cols = cols; L.n = n; L.meta = g;
      const usable = g.usable_blocks ?? n, reserved = g.reserved_blocks ?? 0;
      L.title.textContent = `group ${g.index} · ${g.attention_type} · ${g.num_layers} layers · page ${g.page_size} tokens · `
        + `${usable.toLocaleString()} blocks + ${reserved} reserved padding · `
        + `${(g.tokens_filled || 0).toLocaleString()} tokens filled`;
      const ctx = L.canvas.getContext("2d");
      const img = ctx.createImageData(w, h);
      const px = new Uint32Array(img.data.buffer);
      const pal = kvPalette(g.attention_type, dark);
      // A highlight: its blocks in full colour, the rest faded towards the background.
      const mine = hl.count && hl.blocks && hl.blocks[gi] ? hl.blocks[gi] : null;
      const lit = mine ? new Uint8Array(n) : null;
      if (mine) for (const b of mine) if (b >= 0 && b < n) lit[b] = 1;
      const palDim = lit ? kvPalette(g.attention_type, dark, 0.7, dark ? [24, 24, 24] : [255, 255, 255]) : pal;
      const gap = cell >= 6 ? 1 : 0;
      const inner = cell - gap;
      const base = g.offset;
      for (let b = 0; b < n; b++) {
        const v = cells[base + b] || 0;
        const color = lit && !lit[b] ? palDim[v] : pal[v];
        const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
        for (let y = 0; y < inner; y++) {
          const row = (y0 + y) * w + x0;
          for (let x = 0; x < inner; x++) px[row + x] = color;
        }
      }
      ctx.putImageData(img, 0, 0);
      // Outline the highlighted blocks (shared ones in a second colour) so that they read at any cell size.
      if (mine && mine.length) {
        const sharedSet = new Set((hl.shared && hl.shared[gi]) || []);
        ctx.lineWidth = cell >= 6 ? 1.5 : 1;
        for (const b of mine) {
          if (b < 0 || b >= n) continue;
          ctx.strokeStyle = sharedSet.has(b) ? (dark ? "#ff9cf0" : "#c2188f") : (dark ? "#ffe066" : "#111111");
          const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
          ctx.strokeRect(x0 + 0.5, y0 + 0.5, Math.max(1, inner - 1), Math.max(1, inner - 1));
        }
      }
      // The two reserved padding blocks carry a "P" when the cells are large enough to read it.
      if (cell >= 10) {
        ctx.fillStyle = dark ? "#111" : "#fff";
        ctx.font = `${Math.floor(cell * 0.7)}px sans-serif`;
        ctx.textAlign = "center"; ctx.textBaseline = "middle";
        for (const b of g.padding_blocks || []) {
          if (b >= n) continue;
          ctx.fillText("P", (b % cols) * cell + inner / 2, Math.floor(b / cols) * cell + inner / 2 + 0.5);
        }
      }
    });
    f.root.__cbnbKvGeo = layouts.map((L) => ({ cell: L.cell, cols: L.cols, n: L.n })); // read by the browser tests
    L_updateTip();
  };

  const stateAt = (gi, b) => {
    const g = layouts[gi].meta;
    const v = cbnbBytes(model.get("cells"))[g.offset + b] || 0;
    return { state: KV_STATES[v & 7], refcount: v >> 3 };
  };
  const L_updateTip = () => {
    if (!hovered) return;
    const { state, refcount } = stateAt(hovered.group, hovered.block);
    hovered.local = `group ${hovered.group} · block ${hovered.block} · ${state}` + (refcount ? ` · refcount ${refcount}` : "");
    tip.textContent = hovered.local + (hovered.detail ? `\n${hovered.detail}` : "");
  };

  const onMove = (gi) => (e) => {
    const L = layouts[gi];
    if (!L || !L.cell) return;
    const r = L.canvas.getBoundingClientRect();
    const col = Math.floor((e.clientX - r.left) / L.cell), row = Math.floor((e.clientY - r.top) / L.cell);
    const b = row * L.cols + col;
    if (col < 0 || col >= L.cols || b < 0 || b >= L.n) { tip.style.display = "none"; hovered = null; return; }
    const rootBox = f.root.getBoundingClientRect();
    tip.style.display = "";
    const tx = e.clientX - rootBox.left, tw = tip.offsetWidth;
    tip.style.left = `${tx + 12 + tw <= rootBox.width ? tx + 12 : Math.max(0, tx - 12 - tw)}px`;
    tip.style.top = `${e.clientY - rootBox.top + 12}px`;
    if (hovered && hovered.group === gi && hovered.block === b) return;
    hovered = { group: gi, block: b, seq: ++seq, detail: "" };
    L_updateTip();
    model.send({ kind: "hover", group: gi, block: b, seq: hovered.seq });
  };
  const onLeave = () => {
    tip.style.display = "none";
    if (hovered) model.send({ kind: "hover_request", id: null });
    hovered = null;
  };
  const onMsg = (msg) => {
    if (!msg || msg.kind !== "hover" || !hovered || msg.seq !== hovered.seq) return;
    if (msg.error) hovered.detail = msg.error;
    else {
      const owners = msg.owners && msg.owners.length ? msg.owners.join(", ") : "none";
      hovered.detail = `owner${msg.owners && msg.owners.length > 1 ? "s" : ""}: ${owners} · tokens filled ${msg.tokens}/${msg.page_size}`
        + (msg.padding ? " · padding block" : "") + (msg.note ? `\n${msg.note}` : "");
    }
    f.root.__cbnbKvGeo = layouts.map((L) => ({ cell: L.cell, cols: L.cols, n: L.n })); // read by the browser tests
    L_updateTip();
  };
  model.on("msg:custom", onMsg);
  grids.addEventListener("mouseleave", onLeave);
  const listeners = [];
  const attach = () => {
    layouts.forEach((L, gi) => {
      if (L.bound) return;
      L.bound = true;
      const h = onMove(gi);
      L.canvas.addEventListener("mousemove", h);
      listeners.push([L.canvas, h]);
      const c = (e) => {
        const r = L.canvas.getBoundingClientRect();
        const col = Math.floor((e.clientX - r.left) / L.cell), row = Math.floor((e.clientY - r.top) / L.cell);
        const b = row * L.cols + col;
        if (col >= 0 && col < L.cols && b >= 0 && b < L.n) model.send({ kind: "click", group: gi, block: b });
      };
      L.canvas.addEventListener("click", c);
      listeners.push([L.canvas, c, "click"]);
    });
  };
  const redraw = () => {
    const t0 = performance.now();
    draw();
    attach();
    (f.root.__cbnbDrawMs = f.root.__cbnbDrawMs || []).push(performance.now() - t0);
    if (f.root.__cbnbDrawMs.length > 200) f.root.__cbnbDrawMs.splice(0, 100);
    cbnbRecordRender(model, "kvmap");
  };
  const schedule = cbnbOnFrame(redraw);
  model.on("change:cells", schedule);
  model.on("change:groups", schedule);
  model.on("change:highlight", schedule);
  const offTheme = cbnbOnTheme(redraw);

  // Only ask for snapshots while the map is on screen.
  let obs = null;
  if (typeof IntersectionObserver !== "undefined") {
    obs = new IntersectionObserver((entries) => {
      for (const en of entries) model.send({ kind: "visible", view: viewId, on: en.isIntersecting });
    });
    obs.observe(f.root);
  } else {
    model.send({ kind: "visible", view: viewId, on: true });
  }
  let ro = null;
  if (typeof ResizeObserver !== "undefined") {
    let lastW = 0;
    ro = new ResizeObserver(() => {
      const w = grids.clientWidth;
      if (w && Math.abs(w - lastW) > 8) { lastW = w; redraw(); }
    });
    ro.observe(grids);
  }
  requestAnimationFrame(redraw);
  redraw();
  return () => {
    f.cleanup();
    model.off("msg:custom", onMsg);
    model.off("change:cells", schedule);
    model.off("change:groups", schedule);
    model.off("change:highlight", schedule);
    offTheme();
    for (const [c, h, ev] of listeners) c.removeEventListener(ev || "mousemove", h);
    if (obs) obs.disconnect();
    if (ro) ro.disconnect();
    try { model.send({ kind: "visible", view: viewId, on: false }); } catch (e) { /* comm closed */ }
  };
}

export default { initialize, render };
