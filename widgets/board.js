// Request board: a table of requests with the prompt's first words, state, progress, TTFT, prefix-cache hits,
// offloads and soft resets; Cancel per live row and Cancel all. A click on a row selects the request ("Why?").

const BOARD_HEADERS = {
  id: "request", prompt_text: "prompt", state: "state", output_tokens: "progress", prompt_tokens: "prompt tokens",
  ttft_ms: "TTFT ms", queue_ms: "queue ms", prefix_cached_tokens: "cached", offloads: "offloads",
  soft_resets: "soft resets", sampling: "sampling", error: "error / warning", source: "source",
};
// Data columns drawn inside others: max_new_tokens in the progress bar, warning in the error cell.
const BOARD_HIDDEN = new Set(["max_new_tokens", "warning", "finish_reason"]);
// Shown right after the id whatever its place in `columns` (appended there, so other columns keep their index).
const BOARD_FIRST = ["id", "prompt_text"];
const BOARD_TIPS = {
  prompt_text: "the prompt's first words (as typed; a prompt given as token ids is decoded); hover a cell for more",
  prefix_cached_tokens: "prompt tokens served from the prefix cache",
  offloads: "times swapped out to the host pool", soft_resets: "times re-queued and recomputed",
  ttft_ms: "time to first token", queue_ms: "time waiting before the first step",
  error: "why a request failed, or a warning given when it was admitted",
  sampling: "logits processors and sampling the request applies, in order",
  source: "who sent the request: http <client address> for the HTTP server; – for a call from Python",
};
// transformers sets DECODING when the last prompt chunk is scheduled, before its forward: until that step ends the
// request is DECODING with no token yet.
const BOARD_FIRST_TOKEN_TIP = "DECODING since its last prompt chunk was scheduled (as in transformers); the first "
  + "token arrives when this step ends";

function initialize({ model }) {
  cbnbTrackLatency(model, "board");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-board", "Request board");
  const top = cbnbEl("div", "cbnb-row cbnb-board-top");
  const summary = cbnbEl("div", "cbnb-board-summary");
  const cancelAll = cbnbEl("button", "cbnb-btn cbnb-small cbnb-cancel-all", "Cancel all");
  cancelAll.title = "Cancel every unfinished request (they end CANCELLED; their blocks are freed at once)";
  cancelAll.addEventListener("click", () => model.send({ kind: "cancel_all" }));
  top.append(summary, cancelAll);
  const hint = cbnbEl("div", "cbnb-hint", "Click a row for its story (Why?).");
  const wrap = cbnbEl("div", "cbnb-table-wrap");
  const table = cbnbEl("table", "cbnb-table");
  const thead = cbnbEl("thead");
  const tbody = cbnbEl("tbody");
  table.append(thead, tbody);
  wrap.append(table);
  f.body.append(top, hint, wrap);

  const order = (cols) => [...BOARD_FIRST.filter((c) => cols.includes(c)),
    ...cols.filter((c) => !BOARD_FIRST.includes(c) && !BOARD_HIDDEN.has(c))];
  let headCols = "";
  const drawHead = (cols) => {
    const tr = cbnbEl("tr");
    for (const c of order(cols)) {
      const th = cbnbEl("th", `cbnb-col-${c}`, BOARD_HEADERS[c] || c);
      if (BOARD_TIPS[c]) th.title = BOARD_TIPS[c];
      tr.append(th);
    }
    thead.replaceChildren(tr);
    headCols = cols.join(",");
  };

  // A press holds the rows still until it is released: a redraw between mousedown and mouseup would replace the
  // pressed button, and the browser drops a click whose press and release hit different elements. (At most 1 s:
  // a release outside the window must not freeze the board.)
  let pressedAt = 0, deferred = false;
  const draw = () => {
    if (pressedAt && performance.now() - pressedAt < 1000) { deferred = true; return; }
    const cols = model.get("columns") || [];
    if (headCols !== cols.join(",")) drawHead(cols);
    const ix = Object.fromEntries(cols.map((c, i) => [c, i]));
    const counts = model.get("counts") || {};
    const parts = Object.entries(counts).filter(([, n]) => n > 0).map(([s, n]) => `${n} ${s.toLowerCase()}`);
    const hidden = model.get("hidden") || 0;
    const es = model.get("engine_state") || "";
    const esText = es === "paused" ? "paused (step mode: Step or Resume)" : (es || "?");
    summary.textContent = `engine ${esText} · ` + (parts.length ? parts.join(" · ") : "no requests")
      + (hidden ? ` · ${hidden} older ended requests not listed` : "")
      + (model.get("note") ? ` · ${model.get("note")}` : "");
    const rows = model.get("rows") || [];
    const live = rows.filter((r) => !CBNB_TERMINAL.has(r[ix.state])).length;
    cancelAll.disabled = live === 0;
    cancelAll.textContent = live ? `Cancel all (${live})` : "Cancel all";
    const selected = model.get("selected") || "";
    const trs = rows.map((r) => {
      const tr = cbnbEl("tr");
      const state = r[ix.state];
      tr.dataset.id = r[ix.id];
      tr.dataset.state = state;
      if (r[ix.id] === selected) tr.classList.add("cbnb-selected");
      const firstToken = state === "DECODING" && !r[ix.output_tokens];
      for (const c of order(cols)) {
        const td = cbnbEl("td", `cbnb-col-${c}`);
        const v = r[ix[c]];
        if (c === "state") {
          td.append(cbnbStateBadge(v));
          if (!CBNB_TERMINAL.has(v)) {  // the action next to the state it changes
            const b = cbnbEl("button", "cbnb-btn cbnb-small cbnb-row-cancel", "Cancel");
            b.title = `Cancel ${r[ix.id]} (its blocks are freed at once)`;
            td.append(b);
          }
        }
        else if (c === "prompt_text") {  // at most 3 lines (the rest in the title): rows stay short at 2x
          td.append(cbnbEl("span", "cbnb-clamp", v || "–"));
          td.title = v || "";
        }
        else if (c === "output_tokens") {
          const max = r[ix.max_new_tokens];
          const bar = cbnbEl("div", "cbnb-progress");
          const fill = cbnbEl("div", "cbnb-progress-fill");
          fill.style.width = max ? `${Math.min(100, (100 * v) / max)}%` : "0%";
          bar.append(fill);
          const text = firstToken ? `0/${max ?? "?"} · 1st token in flight` : (max ? `${v}/${max}` : `${v}`);
          td.append(bar, cbnbEl("span", "cbnb-progress-text", text));
          if (firstToken) td.title = BOARD_FIRST_TOKEN_TIP;
        } else if (c === "ttft_ms" && firstToken) { td.textContent = "…"; td.title = BOARD_FIRST_TOKEN_TIP; }
        else if (c === "ttft_ms" || c === "queue_ms") td.textContent = cbnbFmt(v, 0);
        else if (c === "sampling") { td.textContent = v || "–"; td.title = v || ""; }
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
  // One set of listeners on the body: rows are rebuilt on every update.
  const rowOf = (e) => e.target.closest && e.target.closest("tr[data-id]");
  tbody.addEventListener("click", (e) => {
    const tr = rowOf(e);
    if (!tr) return;
    if (e.target.closest(".cbnb-row-cancel")) model.send({ kind: "cancel", id: tr.dataset.id });
    else model.send({ kind: "select", id: tr.dataset.id });
  });
  let hovered = null;
  tbody.addEventListener("mouseover", (e) => {
    const tr = rowOf(e);
    const id = tr ? tr.dataset.id : null;
    if (id !== hovered) { hovered = id; model.send({ kind: "hover_request", id }); }
  });
  wrap.addEventListener("mouseleave", () => { if (hovered) { hovered = null; model.send({ kind: "hover_request", id: null }); } });
  const schedule = cbnbOnFrame(draw);
  tbody.addEventListener("pointerdown", () => { pressedAt = performance.now(); });
  const release = () => {  // the click is dispatched before the next frame, so the redraw follows it
    pressedAt = 0;
    if (deferred) { deferred = false; schedule(); }
  };
  window.addEventListener("pointerup", release, true);
  window.addEventListener("pointercancel", release, true);
  const names = ["rows", "counts", "hidden", "note", "engine_state", "selected", "columns"];
  for (const n of names) model.on(`change:${n}`, schedule);
  draw();
  return () => {
    f.cleanup();
    for (const n of names) model.off(`change:${n}`, schedule);
    window.removeEventListener("pointerup", release, true);
    window.removeEventListener("pointercancel", release, true);
  };
}

export default { initialize, render };
