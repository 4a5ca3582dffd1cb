// Request board: a table of requests with state, progress, TTFT, prefix-cache hits, offloads and soft resets.

const BOARD_HEADERS = {
  id: "request", state: "state", output_tokens: "progress", prompt_tokens: "prompt",
  ttft_ms: "TTFT ms", queue_ms: "queue ms", prefix_cached_tokens: "cached", offloads: "offloads",
  soft_resets: "soft resets", error: "error / warning", source: "source",
};
// Data columns drawn inside others: max_new_tokens in the progress bar, warning in the error cell.
const BOARD_HIDDEN = new Set(["max_new_tokens", "warning", "finish_reason"]);
const BOARD_TIPS = {
  prefix_cached_tokens: "prompt tokens served from the prefix cache",
  offloads: "times swapped out to the host pool", soft_resets: "times re-queued and recomputed",
  ttft_ms: "time to first token", queue_ms: "time waiting before the first step",
  error: "why a request failed, or a warning given when it was admitted",
  source: "who sent the request: http <client address> for the HTTP server; – for a call from Python",
};

function initialize({ model }) {
  cbnbTrackLatency(model, "board");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-board", "Request board");
  const summary = cbnbEl("div", "cbnb-board-summary");
  const wrap = cbnbEl("div", "cbnb-table-wrap");
  const table = cbnbEl("table", "cbnb-table");
  const thead = cbnbEl("thead");
  const tbody = cbnbEl("tbody");
  table.append(thead, tbody);
  wrap.append(table);
  f.body.append(summary, wrap);

  const drawHead = (cols) => {
    const tr = cbnbEl("tr");
    for (const c of cols) {
      if (BOARD_HIDDEN.has(c)) continue;
      const th = cbnbEl("th", null, BOARD_HEADERS[c] || c);
      if (BOARD_TIPS[c]) th.title = BOARD_TIPS[c];
      tr.append(th);
    }
    thead.replaceChildren(tr);
  };

  const draw = () => {
    const cols = model.get("columns") || [];
    if (thead.childElementCount === 0) drawHead(cols);
    const ix = Object.fromEntries(cols.map((c, i) => [c, i]));
    const counts = model.get("counts") || {};
    const parts = Object.entries(counts).filter(([, n]) => n > 0).map(([s, n]) => `${n} ${s.toLowerCase()}`);
    const hidden = model.get("hidden") || 0;
    const es = model.get("engine_state") || "";
    summary.textContent = `engine ${es || "?"} · ` + (parts.length ? parts.join(" · ") : "no requests")
      + (hidden ? ` · ${hidden} older ended requests not listed` : "");
    const rows = model.get("rows") || [];
    const trs = rows.map((r) => {
      const tr = cbnbEl("tr");
      tr.dataset.id = r[ix.id];
      tr.dataset.state = r[ix.state];
      for (const c of cols) {
        if (BOARD_HIDDEN.has(c)) continue;
        const td = cbnbEl("td", `cbnb-col-${c}`);
        const v = r[ix[c]];
        if (c === "state") td.append(cbnbStateBadge(v));
        else if (c === "output_tokens") {
          const max = r[ix.max_new_tokens];
          const bar = cbnbEl("div", "cbnb-progress");
          const fill = cbnbEl("div", "cbnb-progress-fill");
          fill.style.width = max ? `${Math.min(100, (100 * v) / max)}%` : "0%";
          bar.append(fill);
          td.append(bar, cbnbEl("span", "cbnb-progress-text", max ? `${v}/${max}` : `${v}`));
        } else if (c === "ttft_ms" || c === "queue_ms") td.textContent = cbnbFmt(v, 0);
        else if (c === "error") {
          const warn = r[ix.warning], reason = r[ix.finish_reason];
          if (v) { td.textContent = v; td.title = v; }
          else if (warn) {
            td.classList.add("cbnb-warning");
            td.textContent = reason ? `⚠ ended ${reason}: ${warn}` : `⚠ ${warn}`;
            td.title = warn;
          } else td.textContent = "–";
        } else if (c === "source") {
          td.textContent = v || "–";
          if (v) td.title = v;
        } else td.textContent = v === null || v === undefined ? "–" : v;
        tr.append(td);
      }
      return tr;
    });
    tbody.replaceChildren(...trs);
    cbnbRecordRender(model, "board");
  };
  const schedule = cbnbOnFrame(draw);
  const names = ["rows", "counts", "hidden", "engine_state"];
  for (const n of names) model.on(`change:${n}`, schedule);
  draw();
  return () => { f.cleanup(); for (const n of names) model.off(`change:${n}`, schedule); };
}

export default { initialize, render };
