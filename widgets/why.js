// "Why?" view: the selected request's story (Engine.explain, kept live): arrival, the steps it was left out with
// the reason, its numbers and the config field that would change it, prompt chunks, prefix hits, offloads,
// restores, and its end. Opened by clicking a request in the board, a stream card, a timeline row or a KV block.

const WHY_KIND_COLORS = { arrival: "#9e9e9e", prefill: "#4c78a8", decode: "#72b7b2", prefix_hit: "#f58518",
  offload: "#8e44ad", restore: "#8e44ad", warning: "#d4a200", reconfigure: "#555555", end: "#54a24b" };

// An end is coloured by how it ended, as the timeline colours it (FINISHED green, FAILED red, CANCELLED grey).
const WHY_END_COLORS = { light: { FINISHED: "#3f9e3a", FAILED: "#d62728", CANCELLED: "#8a8a8a" },
  dark: { FINISHED: "#6fd06a", FAILED: "#ff6b6b", CANCELLED: "#9a9a9a" } };

function whySwatch(e, theme) {
  if (e.kind === "waiting") return theme.reason(e.reason);
  if (e.kind === "end") {
    const state = String(e.text || "").split(":")[0];
    const c = WHY_END_COLORS[theme.dark ? "dark" : "light"][state];
    if (c) return c;
  }
  return WHY_KIND_COLORS[e.kind] || "#888";
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-why", "Why? (the selected request's story)");
  const head = cbnbEl("div", "cbnb-row cbnb-why-head");
  const headline = cbnbEl("div", "cbnb-why-headline");
  const copy = cbnbEl("button", "cbnb-btn cbnb-small cbnb-why-copy", "Copy as text");
  const close = cbnbEl("button", "cbnb-btn cbnb-small cbnb-why-close", "Close");
  close.addEventListener("click", () => model.send({ kind: "close" }));
  copy.addEventListener("click", async () => {
    try { await navigator.clipboard.writeText(model.get("text") || ""); copy.textContent = "Copied"; }
    catch (e) { copy.textContent = "Select the text to copy"; }
    setTimeout(() => { copy.textContent = "Copy as text"; }, 1500);
  });
  head.append(headline, copy, close);
  const prompt = cbnbEl("div", "cbnb-hint cbnb-why-prompt");
  const empty = cbnbEl("div", "cbnb-empty",
    "Click a request (a board row, a stream card, a timeline row or a KV block) to see why it waits and what happened to it.");
  const list = cbnbEl("ol", "cbnb-why-list");
  const pre = cbnbEl("pre", "cbnb-why-text");
  f.body.append(empty, head, prompt, list, pre);
  let lastId = "";

  const draw = () => {
    const st = model.get("story") || {};
    const rid = model.get("request_id") || "";
    const has = !!rid;
    empty.style.display = has ? "none" : "";
    head.style.display = has ? "" : "none";
    f.root.dataset.request = rid;
    headline.textContent = st.headline || (has ? model.get("text") : "");
    prompt.textContent = st.prompt_text ? `prompt: “${st.prompt_text}”` : "";
    const theme = cbnbTheme(f.root);
    const items = (st.entries || []).map((e) => {
      const li = cbnbEl("li", `cbnb-why-entry cbnb-why-${e.kind}`);
      li.dataset.kind = e.kind;
      if (e.reason) li.dataset.reason = e.reason;
      const sw = cbnbEl("span", "cbnb-swatch");
      sw.style.background = whySwatch(e, theme);
      if (e.kind === "end") li.dataset.state = String(e.text || "").split(":")[0];
      const span = cbnbEl("span", "cbnb-why-span", e.span);
      const text = cbnbEl("span", "cbnb-why-what", e.text);
      li.append(sw, span, text);
      if (e.fields && e.fields.length) {
        const fix = cbnbEl("div", "cbnb-why-fix");
        fix.append(cbnbEl("span", null, "→ change "));
        for (const name of e.fields) fix.append(cbnbEl("code", "cbnb-why-field", name));
        fix.append(cbnbEl("span", null, `: ${e.advice}`));
        li.append(fix);
      }
      return li;
    });
    list.replaceChildren(...items);
    pre.textContent = has && !(st.entries || []).length ? model.get("text") || "" : "";
    pre.style.display = pre.textContent ? "" : "none";
    if (rid && rid !== lastId) {
      // Opened from another panel: bring the story into view (only as far as needed).
      try { f.root.scrollIntoView({ block: "nearest", behavior: "smooth" }); } catch (e) { /* old browsers */ }
    }
    lastId = rid;
  };
  const schedule = cbnbOnFrame(draw);
  const names = ["story", "request_id", "text"];
  for (const n of names) model.on(`change:${n}`, schedule);
  const offTheme = cbnbOnTheme(draw);
  draw();
  return () => { f.cleanup(); offTheme(); for (const n of names) model.off(`change:${n}`, schedule); };
}

export default { render };
