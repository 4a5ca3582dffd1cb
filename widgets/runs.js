// Runs panel: the run log as a table of config points (median [min-max] over repeats), two of them side by side,
// one figure against one config field (median with min-max bars, SVG), and the chosen point's config exported.

const RUNS_TABLE_FIGURES = ["goodput_requests_per_s", "slo_attainment_pct", "ttft_s_p99", "tpot_s_p99",
  "output_tokens_per_s", "soft_resets"];
const RUNS_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"];
const SVG_NS = "http://www.w3.org/2000/svg";

function runsDigits(v) {
  const a = Math.abs(v);
  return a >= 100 ? 0 : a >= 10 ? 1 : a >= 1 ? 2 : 3;
}

function runsNum(v, d) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toFixed(d === undefined ? runsDigits(v) : d);
}

// "1.23 [1.10–1.40]" for a [median, min, max] triple; just the median when there is one run.
function runsSpread(t, n) {
  if (!t || t[0] === null || t[0] === undefined) return "–";
  const d = runsDigits(Math.max(Math.abs(t[1]), Math.abs(t[2])) || Math.abs(t[0]));
  if (n <= 1 || t[1] === t[2]) return runsNum(t[0], d);
  return `${runsNum(t[0], d)} [${runsNum(t[1], d)}–${runsNum(t[2], d)}]`;
}

function runsSvg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function initialize({ model }) {
  cbnbTrackLatency(model, "runs");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-runs", "Runs");
  const summary = cbnbEl("div", "cbnb-hint cbnb-runs-summary");
  const wrap = cbnbEl("div", "cbnb-table-wrap cbnb-runs-table-wrap");
  const table = cbnbEl("table", "cbnb-table cbnb-runs-table");
  const thead = cbnbEl("thead");
  const tbody = cbnbEl("tbody");
  table.append(thead, tbody);
  wrap.append(table);
  const compare = cbnbEl("div", "cbnb-runs-compare");
  const chartBox = cbnbEl("div", "cbnb-runs-chart-box");
  const controls = cbnbEl("div", "cbnb-row cbnb-runs-chart-controls");
  const figSel = cbnbEl("select", "cbnb-runs-figure");
  const fieldSel = cbnbEl("select", "cbnb-runs-field");
  controls.append(cbnbEl("span", "cbnb-subtitle", "chart"), figSel, cbnbEl("span", "cbnb-hint", "against"), fieldSel);
  const chart = cbnbEl("div", "cbnb-runs-chart");
  chartBox.append(controls, chart);
  const exportBox = cbnbEl("div", "cbnb-runs-export");
  const exportRow = cbnbEl("div", "cbnb-row");
  const targetSel = cbnbEl("select", "cbnb-runs-target");
  const exportBtn = cbnbEl("button", "cbnb-btn cbnb-primary cbnb-runs-export-btn", "Export");
  exportBtn.title = "The first selected run group's config, for the chosen engine";
  const copyBtn = cbnbEl("button", "cbnb-btn cbnb-small cbnb-runs-copy", "Copy");
  exportRow.append(cbnbEl("span", "cbnb-subtitle", "export the selected config to"), targetSel, exportBtn, copyBtn);
  const exportText = cbnbEl("pre", "cbnb-code cbnb-runs-export-text");
  exportBox.append(exportRow, exportText);
  const lower = cbnbEl("div", "cbnb-runs-lower");
  lower.append(chartBox, cbnbEl("div", "cbnb-runs-side", null));
  lower.lastChild.append(compare, exportBox);
  f.body.append(summary, wrap, lower);

  const labels = () => Object.fromEntries((model.get("figures") || []).map(([n, l]) => [n, l]));

  const setSelected = (keys) => {
    model.set("selected", keys);
    model.save_changes();
  };

  const drawTable = () => {
    const rows = model.get("rows") || [];
    const sel = model.get("selected") || [];
    const lab = labels();
    const figs = RUNS_TABLE_FIGURES.filter((x) => x in lab);
    const hr = cbnbEl("tr");
    hr.append(cbnbEl("th", null, "compare"), cbnbEl("th", null, "engine"), cbnbEl("th", null, "workload"),
      cbnbEl("th", null, "arrivals"), cbnbEl("th", null, "config change"), cbnbEl("th", null, "runs"));
    for (const x of figs) {
      const th = cbnbEl("th", null, lab[x]);
      th.title = "median [min–max] over the repeats";
      hr.append(th);
    }
    thead.replaceChildren(hr);
    const trs = rows.map((r) => {
      const tr = cbnbEl("tr");
      tr.dataset.key = r.key;
      const ix = sel.indexOf(r.key);
      if (ix >= 0) tr.classList.add("cbnb-runs-selected", ix === 0 ? "cbnb-runs-a" : "cbnb-runs-b");
      const td0 = cbnbEl("td");
      const box = cbnbEl("input", "cbnb-runs-check");
      box.type = "checkbox";
      box.checked = ix >= 0;
      box.title = "pick up to two run groups to compare; the first is the one exported";
      box.addEventListener("change", () => {
        let cur = (model.get("selected") || []).filter((k) => k !== r.key);
        if (box.checked) cur = [...cur, r.key].slice(-2);
        setSelected(cur);
      });
      td0.append(box);
      if (ix >= 0) td0.append(cbnbEl("span", "cbnb-runs-tag", ix === 0 ? "A" : "B"));
      tr.append(td0, cbnbEl("td", "cbnb-runs-engine", r.engine), cbnbEl("td", null, r.workload),
        cbnbEl("td", null, r.arrivals), cbnbEl("td", "cbnb-runs-change", r.change), cbnbEl("td", null, r.n));
      tr.lastChild.title = `run ids ${r.ids.join(", ")}`;
      for (const x of figs) tr.append(cbnbEl("td", `cbnb-runs-fig cbnb-fig-${x}`, runsSpread(r.figures[x], r.n)));
      return tr;
    });
    tbody.replaceChildren(...trs);
    summary.textContent = `${model.get("log_size") || 0} entries in the run log · ${rows.length} config point(s) · `
      + "tick two rows to compare them";
  };

  const drawCompare = () => {
    const rows = model.get("rows") || [];
    const sel = model.get("selected") || [];
    const pick = sel.map((k) => rows.find((r) => r.key === k)).filter(Boolean);
    compare.replaceChildren();
    if (pick.length < 2) {
      compare.append(cbnbEl("div", "cbnb-empty", pick.length ? "Tick a second row to compare." :
        "Tick two rows to compare them side by side."));
      return;
    }
    const [a, b] = pick;
    const t = cbnbEl("table", "cbnb-table cbnb-runs-compare-table");
    const h = cbnbEl("tr");
    h.append(cbnbEl("th", null, "figure"), cbnbEl("th", "cbnb-runs-a", `A: ${a.engine} · ${a.change}`),
      cbnbEl("th", "cbnb-runs-b", `B: ${b.engine} · ${b.change}`), cbnbEl("th", null, "B − A (medians)"));
    t.append(h);
    for (const [name, label, up] of model.get("figures") || []) {
      const ta = a.figures[name], tb = b.figures[name];
      const has = (t) => t && t[0] !== null && t[0] !== undefined;
      if (!has(ta) && !has(tb)) continue;  // neither run measured it
      const tr = cbnbEl("tr");
      tr.dataset.figure = name;
      let diff = "–";
      let cls = "";
      if (ta && tb && ta[0] !== null && tb[0] !== null) {
        const d = tb[0] - ta[0];
        const digits = runsDigits(Math.max(Math.abs(ta[0]), Math.abs(tb[0])));
        const overlap = ta[1] <= tb[2] && tb[1] <= ta[2];
        if (Math.abs(d) < 0.5 * Math.pow(10, -digits)) {  // equal at the shown precision
          diff = "≈ 0";
          cls = "cbnb-runs-overlap";
        } else {
          diff = (d > 0 ? "+" : "") + runsNum(d, digits) + (overlap ? " (ranges overlap)" : "");
          cls = overlap ? "cbnb-runs-overlap" : ((d > 0) === up ? "cbnb-runs-better" : "cbnb-runs-worse");
        }
      }
      tr.append(cbnbEl("td", null, label), cbnbEl("td", null, runsSpread(ta, a.n)),
        cbnbEl("td", null, runsSpread(tb, b.n)), cbnbEl("td", `cbnb-runs-diff ${cls}`, diff));
      t.append(tr);
    }
    const keys = [...new Set([...Object.keys(a.config || {}), ...Object.keys(b.config || {})])];
    const differs = keys.filter((k) => JSON.stringify(a.config[k]) !== JSON.stringify(b.config[k]));
    const cfg = cbnbEl("div", "cbnb-hint cbnb-runs-config-diff",
      differs.length ? "config differs in: " + differs.map((k) => `${k} ${JSON.stringify(a.config[k])} → `
        + `${JSON.stringify(b.config[k])}`).join(", ") : "same config");
    compare.append(t, cfg);
  };

  const fillSelect = (sel, options, value) => {
    const want = JSON.stringify(options);
    if (sel.dataset.options !== want) {
      sel.replaceChildren(...options.map(([v, l]) => { const o = cbnbEl("option", null, l); o.value = v; return o; }));
      sel.dataset.options = want;
    }
    sel.value = value;
  };

  const drawChart = () => {
    fillSelect(figSel, (model.get("figures") || []).map(([n, l]) => [n, l]), model.get("chart_figure"));
    fillSelect(fieldSel, (model.get("fields") || []).map((x) => [x, x]), model.get("chart_field"));
    const c = model.get("chart") || {};
    const series = c.series || [];
    chart.replaceChildren();
    const xs = [];
    for (const s of series) for (const x of s.x) if (!xs.includes(x)) xs.push(x);
    // Numbers in numeric order, then the other values (e.g. "None": a field left to its default).
    const isNum = (x) => x !== "" && !Number.isNaN(Number(x));
    xs.sort((p, q) => (isNum(p) && isNum(q) ? Number(p) - Number(q) : isNum(p) ? -1 : isNum(q) ? 1 : p < q ? -1 : 1));
    if (!xs.length) {
      chart.append(cbnbEl("div", "cbnb-empty", "No run has this figure yet."));
      return;
    }
    let lo = Infinity, hi = -Infinity;
    for (const s of series) for (let i = 0; i < s.x.length; i++) { lo = Math.min(lo, s.lo[i]); hi = Math.max(hi, s.hi[i]); }
    if (lo === hi) { lo -= Math.abs(lo) * 0.1 + 1e-9; hi += Math.abs(hi) * 0.1 + 1e-9; }
    lo = lo < 0 ? lo : Math.max(0, lo - (hi - lo) * 0.15);
    hi += (hi - lo) * 0.1;
    // Round ticks: a step of 1, 2 or 5 x 10^k, about 4 of them.
    const raw = (hi - lo) / 4;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    lo = Math.floor(lo / step) * step;
    hi = Math.ceil(hi / step) * step;
    const tickDigits = Math.max(0, -Math.floor(Math.log10(step)));
    const W = 460, H = 230, L = 56, R = 12, T = 14, B = 40;
    const svg = runsSvg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "cbnb-runs-svg" });
    const px = (i) => L + ((i + 0.5) * (W - L - R)) / xs.length;
    const py = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
    svg.append(runsSvg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "cbnb-runs-axis" }));
    svg.append(runsSvg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "cbnb-runs-axis" }));
    for (let v = lo; v <= hi + step / 2; v += step) {
      svg.append(runsSvg("line", { x1: L, y1: py(v), x2: W - R, y2: py(v), class: "cbnb-runs-grid" }));
      svg.append(runsSvg("text", { x: L - 4, y: py(v) + 3, "text-anchor": "end", class: "cbnb-runs-tick" },
        v.toFixed(tickDigits)));
    }
    xs.forEach((x, i) => svg.append(runsSvg("text", { x: px(i), y: H - B + 14, "text-anchor": "middle",
      class: "cbnb-runs-tick cbnb-runs-xtick" }, x)));
    svg.append(runsSvg("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "cbnb-runs-axis-label" },
      c.field || ""));
    svg.append(runsSvg("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "cbnb-runs-axis-label",
      transform: `rotate(-90 12 ${(T + H - B) / 2})` }, c.label || ""));
    const band = (W - L - R) / xs.length;
    series.forEach((s, si) => {
      const color = RUNS_COLORS[si % RUNS_COLORS.length];
      const off = series.length > 1 ? (si - (series.length - 1) / 2) * Math.min(14, band / (series.length + 1)) : 0;
      const g = runsSvg("g", { class: "cbnb-runs-series", "data-name": s.name });
      s.x.forEach((x, i) => {
        const cx = px(xs.indexOf(x)) + off;
        const bar = runsSvg("line", { x1: cx, x2: cx, y1: py(s.lo[i]), y2: py(s.hi[i]), stroke: color,
          class: "cbnb-runs-bar" });
        const cap1 = runsSvg("line", { x1: cx - 4, x2: cx + 4, y1: py(s.lo[i]), y2: py(s.lo[i]), stroke: color,
          class: "cbnb-runs-cap" });
        const cap2 = runsSvg("line", { x1: cx - 4, x2: cx + 4, y1: py(s.hi[i]), y2: py(s.hi[i]), stroke: color,
          class: "cbnb-runs-cap" });
        const dot = runsSvg("circle", { cx, cy: py(s.median[i]), r: 4, fill: color, class: "cbnb-runs-point",
          "data-x": x, "data-median": s.median[i] });
        dot.append(runsSvg("title", {}, `${s.name}\n${c.field}=${x}: median ${runsNum(s.median[i])}, min `
          + `${runsNum(s.lo[i])}, max ${runsNum(s.hi[i])} (${s.n[i]} run${s.n[i] > 1 ? "s" : ""})`));
        g.append(bar, cap1, cap2, dot);
      });
      svg.append(g);
    });
    chart.append(svg);
    const legend = cbnbEl("div", "cbnb-runs-legend");
    series.forEach((s, si) => {
      const item = cbnbEl("span", "cbnb-runs-legend-item");
      const sw = cbnbEl("span", "cbnb-runs-swatch");
      sw.style.background = RUNS_COLORS[si % RUNS_COLORS.length];
      item.append(sw, document.createTextNode(s.name));
      legend.append(item);
    });
    legend.append(cbnbEl("span", "cbnb-hint", c.higher_is_better ? "· higher is better" : "· lower is better"));
    chart.append(legend);
  };

  const drawExport = () => {
    const targets = Object.entries(model.get("export_targets") || {});
    fillSelect(targetSel, targets, model.get("export_target"));
    const text = model.get("export_text") || "";
    const sel = model.get("selected") || [];
    exportText.textContent = text || (sel.length ? "" : "Tick a row to export its config.");
    exportText.classList.toggle("cbnb-empty", !text);
    exportBtn.disabled = !sel.length;
  };

  figSel.addEventListener("change", () => { model.set("chart_figure", figSel.value); model.save_changes(); });
  fieldSel.addEventListener("change", () => { model.set("chart_field", fieldSel.value); model.save_changes(); });
  targetSel.addEventListener("change", () => { model.set("export_target", targetSel.value); model.save_changes(); });
  exportBtn.addEventListener("click", () => model.send({ kind: "export", target: targetSel.value }));
  copyBtn.addEventListener("click", () => {
    const t = model.get("export_text") || "";
    if (navigator.clipboard && t) navigator.clipboard.writeText(t).catch(() => {});
  });

  const draw = () => {
    drawTable();
    drawCompare();
    drawChart();
    drawExport();
    cbnbRecordRender(model, "runs");
  };
  const schedule = cbnbOnFrame(draw);
  const names = ["rows", "selected", "figures", "fields", "chart", "chart_figure", "chart_field", "export_text",
    "export_target", "log_size"];
  for (const n of names) model.on(`change:${n}`, schedule);
  draw();
  return () => { f.cleanup(); for (const n of names) model.off(`change:${n}`, schedule); };
}

export default { initialize, render };
