// Token stream panel: one card per request (its prompt's first words in the head) whose text grows as tokens
// arrive; cancel buttons for live ones; a click on a card selects the request ("Why?"). Requests that asked for
// logprobs also show their newest tokens as chips: hovering one shows its logprob and the most likely alternatives;
// requests that asked for prompt logprobs show the prompt's last tokens the same way, in a strip of their own.

const cbnbShowToken = (t) => JSON.stringify(t).slice(1, -1);

function cbnbLogprobTip(tok, prompt) {
  const p = (lp) => `${lp.toFixed(3)} (p=${Math.exp(lp).toPrecision(3)})`;
  const what = prompt ? "prompt token" : "token";
  const lines = [`${what} ${tok.i}: "${cbnbShowToken(tok.t)}"  logprob ${p(tok.lp)}`];
  if (tok.top && tok.top.length) {
    lines.push("alternatives:");
    for (const [t, lp] of tok.top) lines.push(`  "${cbnbShowToken(t)}"  ${p(lp)}`);
  }
  return lines.join("\n");
}

function initialize({ model }) {
  cbnbTrackLatency(model, "stream");
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-stream", "Token stream");
  const list = cbnbEl("div", "cbnb-stream-list");
  const empty = cbnbEl("div", "cbnb-empty", "No requests yet: submit a prompt.");
  f.body.append(empty, list);
  const cards = new Map(); // id -> {card, badge, count, text, error, cancel, strip, last}
  const tip = cbnbEl("div", "cbnb-lp-tip");
  tip.style.display = "none";
  f.body.append(tip);
  f.root.style.position = "relative";
  const showTip = (chip, tok, prompt) => {
    tip.textContent = cbnbLogprobTip(tok, prompt);
    const r = chip.getBoundingClientRect(), base = f.root.getBoundingClientRect();
    tip.style.top = `${r.bottom - base.top + 4}px`;
    tip.style.display = "";
    // kept inside the panel: a chip near the right edge opens its tip leftwards
    tip.style.left = `${Math.max(0, Math.min(r.left - base.left, base.width - tip.offsetWidth - 4))}px`;
  };

  const makeCard = (id) => {
    const card = cbnbEl("div", "cbnb-stream-item");
    card.dataset.id = id;
    const head = cbnbEl("div", "cbnb-stream-head");
    const name = cbnbEl("span", "cbnb-req-id", id);
    const prompt = cbnbEl("span", "cbnb-stream-prompt");
    const badge = cbnbEl("span");
    const count = cbnbEl("span", "cbnb-count");
    const cancel = cbnbEl("button", "cbnb-btn cbnb-small cbnb-cancel", "Cancel");
    cancel.title = "Cancel this request (its blocks are freed at once)";
    cancel.addEventListener("click", (e) => { e.stopPropagation(); model.send({ kind: "cancel", id }); });
    head.append(name, badge, prompt, count, cancel);
    const text = cbnbEl("div", "cbnb-stream-text");
    const pstrip = cbnbEl("div", "cbnb-lp-strip cbnb-lp-prompt");
    pstrip.style.display = "none";
    const strip = cbnbEl("div", "cbnb-lp-strip");
    strip.title = "";
    const error = cbnbEl("div", "cbnb-stream-error");
    card.append(head, pstrip, text, strip, error);
    card.title = "Click for this request's story (Why?)";
    card.addEventListener("click", () => model.send({ kind: "select", id }));
    card.addEventListener("mouseenter", () => model.send({ kind: "hover_request", id }));
    card.addEventListener("mouseleave", () => model.send({ kind: "hover_request", id: null }));
    return { card, badge, count, text, error, cancel, prompt, strip, pstrip, last: {} };
  };

  const drawStrip = (strip, lp, prompt) => {
    strip.style.display = lp.length ? "" : "none";
    const chips = lp.map((tok) => {
      const chip = cbnbEl("span", "cbnb-lp-tok", cbnbShowToken(tok.t) || "\u00a0");
      chip.dataset.i = tok.i;
      // darker = more likely (p = exp(logprob))
      chip.style.setProperty("--cbnb-lp-alpha", Math.exp(tok.lp).toFixed(3));
      chip.addEventListener("mouseenter", () => showTip(chip, tok, prompt));
      chip.addEventListener("mouseleave", () => { tip.style.display = "none"; });
      return chip;
    });
    if (prompt && lp.length) chips.unshift(cbnbEl("span", "cbnb-lp-label", "prompt"));
    strip.replaceChildren(...chips);
  };
  const changed = (a, b) => a.length !== b.length || (a.length > 0 && a[a.length - 1].i !== b[b.length - 1].i);

  const draw = () => {
    const items = model.get("items") || [];
    empty.style.display = items.length ? "none" : "";
    const seen = new Set();
    items.forEach((it, i) => {
      seen.add(it.id);
      let c = cards.get(it.id);
      if (!c) { c = makeCard(it.id); cards.set(it.id, c); }
      if (c.last.state !== it.state) {
        c.badge.replaceWith((c.badge = cbnbStateBadge(it.state)));
        c.card.dataset.state = it.state;
        c.card.classList.toggle("cbnb-ended", CBNB_TERMINAL.has(it.state));
        c.cancel.style.display = CBNB_TERMINAL.has(it.state) ? "none" : "";
      }
      if (c.last.prompt !== it.prompt) { c.prompt.textContent = it.prompt || ""; c.prompt.title = it.prompt || ""; }
      c.card.classList.toggle("cbnb-selected", it.id === (model.get("selected") || ""));
      const count = it.max ? `${it.n}/${it.max} tokens` : `${it.n} tokens`;
      if (c.count.textContent !== count) c.count.textContent = count;
      if (c.last.text !== it.text) c.text.textContent = it.text;
      const lp = it.lp || [], plp = it.plp || [];
      if (changed(lp, c.last.lp || [])) drawStrip(c.strip, lp, false);
      if (changed(plp, c.last.plp || [])) drawStrip(c.pstrip, plp, true);
      const err = it.error ? `${it.state === "CANCELLED" ? "cancelled" : "error"}: ${it.error}` : "";
      if (c.error.textContent !== err) c.error.textContent = err;
      c.error.style.display = err ? "" : "none";
      c.last = it;
      if (list.children[i] !== c.card) list.insertBefore(c.card, list.children[i] || null);
    });
    for (const [id, c] of cards) {
      if (!seen.has(id)) { c.card.remove(); cards.delete(id); }
    }
    cbnbRecordRender(model, "stream");
  };
  const schedule = cbnbOnFrame(draw);
  model.on("change:items", schedule);
  model.on("change:selected", schedule);
  draw();
  return () => { f.cleanup(); model.off("change:items", schedule); model.off("change:selected", schedule); };
}

export default { initialize, render };
