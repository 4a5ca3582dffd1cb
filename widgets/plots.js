// Live plots: plotly.js draws six charts from float32 series held in traitlets, so a reloaded page shows the
// current data. plotly.js itself comes once per kernel from a hidden PlotlyLib widget (model id in `_lib`) and is
// evaluated once per page. Every chart shares the engine's step number as x, follows the last `window` steps, and
// marks run segments (reconfigure, reset_stats, workload) with a labelled line; earlier segments are faded.

function loadPlotly(model) {
  if (globalThis.Plotly) return Promise.resolve(globalThis.Plotly);
  if (!globalThis.__cbnbPlotly) {
    globalThis.__cbnbPlotly = (async () => {
      const lib = await model.widget_manager.get_model(model.get("_lib"));
      const src = cbnbBytes(lib.get("source"));
      if (!src.byteLength) throw new Error("plotly.js was not sent by the kernel");
      const url = URL.createObjectURL(new Blob([src], { type: "text/javascript" }));
      try {
        await import(/* webpackIgnore: true */ url); // the bundle sets window.Plotly
      } finally {
        URL.revokeObjectURL(url);
      }
      if (!globalThis.Plotly) throw new Error("plotly.js did not load");
      return globalThis.Plotly;
    })().catch((e) => { globalThis.__cbnbPlotly = null; throw e; });
  }
  return globalThis.__cbnbPlotly;
}

// The x range every chart shows, following recent activity: the current run, with as many steps of context before
// it (at least 20), at most the last `window` steps; so a short new run is never squeezed against a long history.
function plotsRange(step, tstep, windowSteps, run) {
  let lo = Infinity, hi = -Infinity;
  for (const xs of [step, tstep]) for (const v of xs) if (Number.isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (!Number.isFinite(hi)) return [0, 10];
  lo = Math.max(lo, hi - windowSteps + 1);
  if (run && run.index > 0 && run.step < hi) lo = Math.max(lo, run.step - Math.max(20, hi - run.step));
  return [lo - 0.5, Math.max(hi + 0.5, lo + 9.5)];
}

// The six charts, each its own small plotly figure, so that a redraw blocks the page for one small chart at most.
// Returns builders: a chart's arrays are converted only when it is drawn.
// `width`: the chart's width in pixels (run-marker labels wrap to fit inside the plot area).
function plotsFigures(model, theme, scale, width = 420) {
  const st = model.get("steps") || {};
  const se = model.get("series") || {};
  const sm = model.get("summary") || {};
  const reasons = model.get("reasons") || [];
  const info = model.get("reason_info") || {};
  const runs = model.get("runs") || [];
  const S = (k) => Array.from(cbnbFloats(st[k]));
  const T = (k) => Array.from(cbnbFloats(se[k]));
  const step = S("step"), tstep = T("step"), tt = T("t");
  // Per-step traces are drawn as steps centred on their step number: from s-0.5 to s+0.5 (shape "hv" from s-0.5),
  // with the last value repeated at the right edge, so the newest step is a whole bar, not a sliver cut at the
  // edge. The hover rounds x back to the step (xaxis.hoverformat).
  const stepX = step.map((v) => v - 0.5);
  if (step.length) stepX.push(step[step.length - 1] + 0.499);
  const SX = (k) => { const y = S(k); if (y.length) y.push(y[y.length - 1]); return y; };
  const cur = runs.length ? runs[runs.length - 1] : { index: 0, step: 0, label: "" };
  const range = plotsRange(step, tstep, model.get("window") || 240, cur);
  const fs = (px) => Math.round(px * scale * 10) / 10;
  const line = (name, x, y, color, extra = {}) => {
    const { line: l = {}, ...rest } = extra;
    return { type: "scatter", mode: "lines", name, x, y, ...rest, line: { color, width: 1.8, ...l } };
  };
  // Time traces: x is the step the engine had reached; the hover also gives the time.
  const tline = (name, key, color, extra = {}, fmt = ".1f") => line(name, tstep, T(key), color, {
    customdata: tt, hovertemplate: `%{y:${fmt}} (t %{customdata:.1f} s)`, ...extra });
  // Stacked step areas: one SVG path per trace whatever the number of steps.
  const area = (name, y, color, group, extra = {}) => ({ type: "scatter", mode: "lines", name, x: stepX, y,
    stackgroup: group, line: { shape: "hv", width: 0.5, color }, fillcolor: color, ...extra });
  const axis = (title, extra = {}) => ({ title: { text: title, font: { size: fs(10) }, standoff: 4 },
    tickfont: { size: fs(10) }, gridcolor: theme.grid, linecolor: theme.grid, zerolinecolor: theme.grid,
    rangemode: "tozero", automargin: true, ...extra });
  // Run segments: a dashed line where each run starts (labelled), and a veil over everything before this run.
  const shapes = [], notes = [];
  const inRange = (x) => x > range[0] && x < range[1];
  // Labels: the newest run in full (wrapped onto lines, never cut); an older one as "run k" where there is room
  // before the next label. A label sits inside the plot area on the side of its line with more room, so it
  // neither runs off the chart nor over the axes' tick labels.
  const shown = runs.filter((r) => r.index > 0 && inRange(r.step + 0.5));
  const span = range[1] - range[0];
  const plotPx = Math.max(120, width - (52 + 52) * scale);
  let nextX = Infinity;
  for (let k = shown.length - 1; k >= 0; k--) {
    const r = shown[k], x = r.step + 0.5;
    shapes.push({ type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
      line: { color: theme.fg2, width: 1, dash: "dash" } });
    const newest = k === shown.length - 1;
    if (!newest && nextX - x < 0.12 * span) continue;
    const right = (x - range[0]) / span > 0.5; // more room to the left of the line
    const roomPx = plotPx * (right ? (x - range[0]) / span : (range[1] - x) / span) - 8;
    const chars = Math.max(10, Math.floor(roomPx / (fs(9) * 0.6)));
    const text = newest ? plotsWrap(`run ${r.index}: ${r.label || r.cause}`, chars) : `run ${r.index}`;
    notes.push({ text, x, y: 1, xref: "x", yref: "paper", xanchor: right ? "right" : "left", yanchor: "top",
      xshift: right ? -2 : 2, showarrow: false, align: right ? "right" : "left",
      font: { size: fs(9), color: theme.fg2 }, bgcolor: theme.veil, borderpad: 1 });
    nextX = x;
  }
  if (cur.index > 0 && cur.step + 0.5 > range[0]) {
    shapes.push({ type: "rect", xref: "x", yref: "paper", x0: range[0], x1: Math.min(range[1], cur.step + 0.5),
      y0: 0, y1: 1, fillcolor: theme.veil, line: { width: 0 }, layer: "above" });
  }
  const layout = (title, yTitle, extra = {}) => {
    const { annotations = [], ...rest } = extra;
    return {
      height: Math.round(250 * (1 + 0.6 * (scale - 1))),
      margin: { l: Math.round(52 * scale), r: Math.round((rest.yaxis2 ? 52 : 14) * scale), t: Math.round(58 * scale),
        b: Math.round(36 * scale) },
      title: { text: title, font: { size: fs(12), color: theme.fg }, x: 0.01, xanchor: "left", y: 0.985,
        yanchor: "top" },
      font: { color: theme.fg }, paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      hovermode: "x unified", showlegend: true,
      hoverlabel: { bgcolor: theme.bg, font: { color: theme.fg, size: fs(11) } },
      legend: { orientation: "h", x: 0, y: 1.02, xanchor: "left", yanchor: "bottom", font: { size: fs(10) } },
      xaxis: axis("step", { range, autorange: false, rangemode: "normal", hoverformat: ".0f" }),
      yaxis: axis(yTitle),
      shapes, annotations: [...notes, ...annotations],
      ...rest, datarevision: Date.now(),
    };
  };
  // Right axes: plotly aligns an overlaying axis's ticks to the left grid by default ("sync"), which gives ticks
  // such as 29.7 / 59.4 / 89.1; "auto" picks round numbers.
  const y2 = (title, extra = {}) => axis(title, { overlaying: "y", side: "right", showgrid: false, tickmode: "auto",
    nticks: 6, ...extra });
  // Counts are whole numbers: ticks 1 apart at least (plotly's own choice for a small range is 0.5: "0, 1, 1, 2").
  const intAxis = (ys) => {
    let m = 0;
    for (const y of ys) for (const v of y) if (v > m) m = v;
    const top = Math.max(2, Math.ceil(m * 1.15));
    const raw = top / 4, p = Math.pow(10, Math.floor(Math.log10(raw)));
    const dtick = Math.max(1, [1, 2, 2.5, 5, 10].map((k) => k * p).find((d) => d >= raw) || 10 * p);
    return { range: [0, top], autorange: false, dtick: Math.round(dtick) || 1, tickmode: "linear", tick0: 0 };
  };
  const note = (text) => ({ text, x: 0.5, y: 0.5, xref: "paper", yref: "paper", showarrow: false,
    font: { size: fs(11), color: theme.fg2 } });
  const thisRun = cur.index > 0 ? `run ${cur.index}` : "this run";

  const f1 = () => {
    const decode = SX("decode");
    return {
      traces: [area("decode", decode, theme.pal.decode, "tok", { hovertemplate: "%{y} tokens" }),
        area("prefill", SX("prefill"), theme.pal.prefill, "tok", { hovertemplate: "%{y} tokens" }),
        line("max_batch_tokens", stepX, SX("budget"), theme.fg, { line: { dash: "dash", shape: "hv", width: 1.2 },
          hovertemplate: "%{y}" }),
        // Decode steps add one token per request: invisible beside a 256-token prefill on one scale.
        line("decode tokens (right axis)", stepX, decode, theme.pal.decodeLine,
          { yaxis: "y2", line: { shape: "hv", width: 2 }, hovertemplate: "%{y}" })],
      layout: layout("Tokens per step: prefill vs decode, against max_batch_tokens", "tokens",
        { yaxis2: y2("decode tokens", intAxis([decode])) }),
    };
  };
  const f2 = () => {
    const skipTraces = [];
    reasons.forEach((r) => {
      const y = SX(`skip_${r}`);
      if (!y.some((v) => v > 0)) return;
      const ri = info[r] || {};
      skipTraces.push(area(ri.label || r.replace(/_/g, " "), y, theme.reason(r), "skip",
        { hovertemplate: "%{y} left out", meta: r }));
    });
    return {
      traces: skipTraces,
      layout: layout("Requests left out per step, by reason", "requests",
        skipTraces.length ? { yaxis: axis("requests", intAxis([skipTraces.reduce((acc, t) => acc.map((v, k) => v + (t.y[k] || 0)),
          new Array(stepX.length).fill(0))])) } : { yaxis: axis("requests", { range: [0, 4], autorange: false }),
          annotations: [note(step.length ? "no request was left out in these steps" : "no steps yet")] }),
      reasons: skipTraces.map((t) => t.meta),
    };
  };
  const f3 = () => ({
    traces: [tline("by blocks", "kv_blocks_pct", theme.pal.blue), tline("by tokens", "kv_tokens_pct", theme.pal.green)],
    layout: layout("KV usage, % of the cache: by blocks and by tokens", "%"),
  });
  const f4 = () => ({
    traces: [tline("hit tokens", "prefix_hit_tokens", theme.pal.orange, {}, ".0f"),
      tline("hit %", "prefix_hit_pct", theme.pal.red, { yaxis: "y2", line: { dash: "dot" } })],
    layout: layout(`Prefix-cache hits, ${thisRun}: ${cbnbFmt(sm.prefix_hit_tokens, 0)} tokens, ${cbnbFmt(sm.prefix_hit_pct)} %`,
      "tokens", { yaxis2: y2("%", { range: [0, 100], autorange: false, rangemode: "normal" }) }),
  });
  const hv = { shape: "hv" };
  const counts = ["swaps", "soft_resets", "restores", "graph_captures", "graph_replays"];
  const f5 = () => ({
    traces: [tline("swaps", "swaps", theme.pal.purple, { line: hv }, ".0f"),
      tline("soft resets", "soft_resets", theme.pal.red, { line: hv }, ".0f"),
      tline("restores", "restores", theme.pal.brown, { line: hv }, ".0f"),
      tline("graph captures", "graph_captures", theme.pal.blue, { line: { ...hv, dash: "dot" } }, ".0f"),
      tline("graph replays", "graph_replays", theme.pal.teal, { line: { ...hv, dash: "dot" } }, ".0f")],
    layout: layout(`Offloads, soft resets, restores (${thisRun}); CUDA graphs`, "count",
      { yaxis: axis("count", intAxis(counts.map((k) => T(k).filter(Number.isFinite)))) }),
  });
  const f6 = () => ({
    traces: [tline("output tok/s", "out_tok_s", theme.pal.blue), tline("prefill tok/s", "prefill_tok_s", theme.pal.grey),
      tline("TTFT p50", "ttft_p50_ms", theme.pal.orange, { yaxis: "y2", line: { dash: "dot" } }, ".0f"),
      tline("TPOT p50", "tpot_p50_ms", theme.pal.red, { yaxis: "y2", line: { dash: "dot" } }, ".0f")],
    layout: layout("Throughput (tokens/s) and latency (ms)", "tokens/s", { yaxis2: y2("ms") }),
  });
  return [f1, f2, f3, f4, f5, f6];
}

// `text` broken into lines of at most `n` characters at spaces and commas (plotly annotations take <br>).
function plotsWrap(text, n) {
  const words = String(text).split(/(?<=[ ,])/);
  const lines = [];
  let cur = "";
  for (const w of words) {
    if (cur && (cur + w).trimEnd().length > n) { lines.push(cur.trimEnd()); cur = ""; }
    cur += w;
  }
  if (cur.trim()) lines.push(cur.trimEnd());
  return lines.join("<br>");
}

function plotsGraphNote(sm) {
  return `CUDA graphs: ${sm.graph_captures ?? 0} captures, ${sm.graph_replays ?? 0} replays`
    + (sm.graph_capture_failures ? `, ${sm.graph_capture_failures} failed captures (those shapes run eagerly)` : "")
    + (sm.graphs_enabled ? "" : ` (${sm.device || "cpu"}: graphs off)`);
}

function plotsSummaryText(sm) {
  if (!sm || sm.steps === undefined) return "No steps yet in this run.";
  const run = sm.run_index ? `run ${sm.run_index} (${sm.run_label || sm.run_cause}) · ` : "";
  return run + `output ${cbnbFmt(sm.out_tok_s)} tok/s now (${cbnbFmt(sm.run_out_tok_s)} over the run) · `
    + `TTFT p50 ${cbnbFmt(sm.ttft_p50_ms, 0)} ms`
    + (sm.ttft_of && sm.ttft_of !== "finished" ? ` (of ${sm.ttft_of}: none finished yet)` : "") + ` · TPOT p50 ${cbnbFmt(sm.tpot_p50_ms, 0)} ms · `
    + `KV ${cbnbFmt(sm.kv_blocks_pct)} % blocks / ${cbnbFmt(sm.kv_tokens_pct)} % tokens · `
    + `prefix hits ${cbnbFmt(sm.prefix_hit_tokens, 0)} tokens (${cbnbFmt(sm.prefix_hit_pct)} %) · `
    + `swaps ${sm.swaps} · soft resets ${sm.soft_resets} · CUDA graphs ${sm.graph_captures}/${sm.graph_replays}`
    + (sm.graph_capture_failures ? ` (${sm.graph_capture_failures} failed: eager)` : "")
    + (sm.graphs_enabled ? "" : ` (${sm.device}: off)`) + ` · ${sm.steps} steps, ${sm.finished} finished`;
}

function initialize({ model }) {
  cbnbTrackLatency(model, "plots");
}

async function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-plots", "Live plots");
  const bar = cbnbEl("div", "cbnb-row");
  const summary = cbnbEl("div", "cbnb-plots-summary");
  const newRun = cbnbEl("button", "cbnb-btn cbnb-small cbnb-new-run", "New run");
  newRun.title = "Reset the engine's run statistics: the plots start a new segment here (earlier ones are faded)";
  newRun.addEventListener("click", () => model.send({ kind: "new_run" }));
  bar.append(summary, newRun);
  const grid = cbnbEl("div", "cbnb-plot-grid");
  const cells = Array.from({ length: 6 }, () => grid.appendChild(cbnbEl("div", "cbnb-plot-cell")));
  const plots = cells.map((c) => c.appendChild(cbnbEl("div", "cbnb-plot")));
  // Under the skip chart: each reason's one-line meaning; under the offload chart: the CUDA-graph note (outside
  // the plot area, so that it never covers a line).
  const reasonLegend = cells[1].appendChild(cbnbEl("div", "cbnb-reason-legend"));
  const graphNote = cells[4].appendChild(cbnbEl("div", "cbnb-plot-note cbnb-graph-note"));
  const status = cbnbEl("div", "cbnb-hint", "Loading plotly.js…");
  f.body.append(bar, status, grid);
  let alive = true, drawing = false, soon = null, idle = null, next = 0, P = null, lastDraw = 0;
  // A chart redraw blocks the page for 15-150 ms. Updates come in bursts, one per poller tick (<= 10 Hz), the
  // plots panel's message last; drawing right after that message, and at most one chart every MIN_GAP_MS, lets
  // the draw finish in the quiet gap before the next burst. (Measured on 2 shared cores: drawing on a free-running
  // timer landed draws on top of bursts and pushed the other panels' p95 latency to 85-125 ms.)
  const MIN_GAP_MS = 250;
  const AFTER_BURST_MS = 10;
  const QUIET_MS = 300;
  let lastChange = 0;
  const dirty = new Set([0, 1, 2, 3, 4, 5]);
  // Charts scrolled out of view are not redrawn (they stay dirty until they come back).
  const visible = new Set(typeof IntersectionObserver === "undefined" ? [0, 1, 2, 3, 4, 5] : []);
  const pick = () => {
    for (let k = 0; k < 6; k++) {
      const i = (next + k) % 6;
      if (dirty.has(i) && visible.has(i)) return i;
    }
    return -1;
  };
  // Every chart shows the run markers and the shared x range, so steps and runs dirty all of them.
  const ALL = [0, 1, 2, 3, 4, 5];
  const CHARTS_OF = { steps: ALL, series: ALL, summary: [3, 4, 5], reasons: [1], runs: ALL, reason_info: [1],
    window: ALL };

  const drawReasonLegend = (present) => {
    const info = model.get("reason_info") || {};
    const theme = cbnbTheme(f.root);
    reasonLegend.replaceChildren(...present.map((r) => {
      const it = cbnbEl("div", "cbnb-legend-item");
      it.dataset.reason = r;
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = theme.reason(r);
      const ri = info[r] || {};
      it.append(sw, cbnbEl("b", null, ri.label || r), cbnbEl("span", null, `: ${ri.meaning || ""}`));
      if (ri.fields && ri.fields.length) it.title = `change it with: ${ri.fields.join(", ")}`;
      return it;
    }));
  };

  // One chart per draw, round robin over the dirty visible charts; the rest are drawn once updates pause.
  const drawOne = async () => {
    soon = null;
    if (!P || drawing || !alive) return;
    const i = pick();
    if (i < 0) return;
    drawing = true;
    try {
      next = (i + 1) % 6;
      dirty.delete(i);
      const fig = plotsFigures(model, cbnbTheme(f.root), cbnbScale(f.root), plots[i].clientWidth || 420)[i]();
      const t0 = performance.now();
      await P.react(plots[i], fig.traces, fig.layout, { displayModeBar: false, responsive: true });
      refit(plots[i]); // the cell may have changed width while the figure was being made
      if (i === 1) drawReasonLegend(fig.reasons || []);
      if (i === 4) graphNote.textContent = plotsGraphNote(model.get("summary") || {});
      lastDraw = performance.now();
      const cost = lastDraw - t0;
      grid.__cbnbDraws = (grid.__cbnbDraws || 0) + 1;
      // [wall start (s), cost (ms), chart], read by the browser tests.
      (grid.__cbnbDrawAt = grid.__cbnbDrawAt || []).push([Date.now() / 1000 - cost / 1000, Math.round(cost), i]);
      if (grid.__cbnbDrawAt.length > 400) grid.__cbnbDrawAt.splice(0, 200);
    } finally {
      drawing = false;
    }
  };
  // Only while updates pause: drawing back to back during a run would land draws on top of the bursts.
  const quiet = () => performance.now() - lastChange >= QUIET_MS;
  const catchUp = async () => {
    idle = null;
    while (alive && pick() >= 0 && !soon && quiet()) {
      await drawOne();
      await new Promise((r) => setTimeout(r, 50)); // let widget messages through between charts
    }
  };
  const changed = (name) => () => {
    lastChange = performance.now();
    for (const i of CHARTS_OF[name] || []) dirty.add(i);
    if (name === "summary") {
      summary.textContent = plotsSummaryText(model.get("summary"));
      graphNote.textContent = plotsGraphNote(model.get("summary") || {});
    }
    if (!P) return;
    // Not due yet: the chart stays dirty and is drawn after a later burst, or by catchUp once updates pause.
    if (!soon && performance.now() - lastDraw >= MIN_GAP_MS) soon = setTimeout(drawOne, AFTER_BURST_MS);
    if (idle) clearTimeout(idle);
    idle = setTimeout(catchUp, QUIET_MS);
  };
  let io = null;
  if (typeof IntersectionObserver !== "undefined") {
    io = new IntersectionObserver((entries) => {
      for (const en of entries) {
        const i = plots.indexOf(en.target);
        if (en.isIntersecting) visible.add(i); else visible.delete(i);
      }
      if (P && !idle && pick() >= 0) idle = setTimeout(catchUp, 0);
    });
    plots.forEach((d) => io.observe(d));
  }
  // Whether a drawn chart's SVG is as wide as its cell. Plotly sizes it at a draw or a resize; a resize that raced a
  // draw, or ran while the chart was hidden (Plotly then skips it), left the old width, and no later width change
  // came to fix it (CI saw a chart 79 px wider than its cell after the font scale went to 2x).
  const fits = (d) => {
    const svg = d.querySelector(".main-svg");
    return !svg || Math.abs(svg.getBoundingClientRect().width - d.getBoundingClientRect().width) <= 1;
  };
  // Resize until the chart fits its cell, a few tries apart (bounded: a chart that cannot fit stops trying).
  const refit = (d, tries = 4) => {
    if (!alive || !P || !d._fullLayout || tries <= 0 || fits(d)) return;
    Promise.resolve()
      .then(() => P.Plots.resize(d))
      .catch(() => {}) // hidden right now: the next width change (shown again) refits it
      .then(() => setTimeout(() => refit(d, tries - 1), 150));
  };
  // Plotly's `responsive` follows the window only: a chart whose cell changes width (the grid reflows at another
  // font scale, a narrower output) is resized here, else it keeps its old width and spills over its neighbours.
  let ro = null;
  if (typeof ResizeObserver !== "undefined") {
    ro = new ResizeObserver((entries) => {
      for (const en of entries) {
        if (Math.round(en.contentRect.width)) refit(en.target); // not drawn yet: its first draw fits
      }
    });
    plots.forEach((d) => ro.observe(d));
  }
  const names = Object.keys(CHARTS_OF);
  const handlers = names.map((n) => [n, changed(n)]);
  for (const [n, h] of handlers) model.on(`change:${n}`, h);
  // A JupyterLab theme switch or a new font scale redraws every chart in the new colours and sizes.
  const offTheme = cbnbOnTheme(() => {
    for (const i of ALL) dirty.add(i);
    lastChange = 0;
    if (P && !idle) idle = setTimeout(catchUp, 0);
  });
  summary.textContent = plotsSummaryText(model.get("summary"));
  graphNote.textContent = plotsGraphNote(model.get("summary") || {});
  try {
    P = await loadPlotly(model);
    status.remove();
    if (alive) await catchUp();
  } catch (e) {
    status.textContent = `Plots unavailable: ${e && e.message ? e.message : e}`;
    status.className = "cbnb-message cbnb-msg-error";
  }
  return () => {
    alive = false;
    if (soon) clearTimeout(soon);
    if (idle) clearTimeout(idle);
    if (io) io.disconnect();
    if (ro) ro.disconnect();
    offTheme();
    f.cleanup();
    for (const [n, h] of handlers) model.off(`change:${n}`, h);
    if (P) for (const d of plots) { try { P.purge(d); } catch (e) { /* already gone */ } }
  };
}

export default { initialize, render };
