// Server panel: the engine's OpenAI-compatible servers, copyable curl / openai snippets, live counters.

function initialize({ model }) {
  cbnbTrackLatency(model, "server");
}

async function cbnbCopy(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (e) {
    // No clipboard API (an insecure origin): copy through a selected textarea instead.
    const ta = cbnbEl("textarea");
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    const ok = document.execCommand("copy");
    ta.remove();
    return ok;
  }
}

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-server", "Server");
  const empty = cbnbEl("div", "cbnb-empty");
  empty.textContent = "Not serving. In a cell: from cbnb.server import serve; server = serve(engine, port=8000)";
  const list = cbnbEl("div", "cbnb-server-list");
  f.body.append(empty, list);

  const snippetBox = (name, which, text) => {
    const box = cbnbEl("div", "cbnb-snippet");
    box.dataset.which = which;
    const head = cbnbEl("div", "cbnb-snippet-head");
    const label = cbnbEl("span", "cbnb-field-label", name);
    const btn = cbnbEl("button", "cbnb-btn cbnb-small cbnb-copy", "Copy");
    btn.title = `Copy the ${name} snippet`;
    btn.addEventListener("click", async () => {
      if (await cbnbCopy(box.querySelector("pre").textContent)) {
        btn.textContent = "Copied";
        setTimeout(() => { btn.textContent = "Copy"; }, 1500);
        model.send({ kind: "copied", which });
      }
    });
    head.append(label, btn);
    const pre = cbnbEl("pre", "cbnb-code", text);
    box.append(head, pre);
    return box;
  };

  const STATS = [
    ["clients", "clients", "distinct client addresses with a request in flight"],
    ["in_flight", "in flight", "generation requests running now"],
    ["connections", "connections", "open HTTP connections"],
    ["requests_per_s", "req/s", "requests completed per second, last 10 s"],
    ["requests_total", "requests", "generation requests since the server started"],
    ["errors", "errors", "responses with a 4xx/5xx status"],
  ];

  // One card per server URL, built once; counters are updated in place (a selection in a snippet survives).
  const cards = new Map(); // url -> {card, values: {key: element}, snippets}
  const makeCard = (s) => {
    const card = cbnbEl("div", "cbnb-server-item");
    card.dataset.url = s.url;
    const head = cbnbEl("div", "cbnb-server-head");
    const link = cbnbEl("a", "cbnb-server-url", s.url);
    link.href = s.url + "/models";
    link.target = "_blank";
    head.append(link, cbnbEl("span", "cbnb-hint", `model ${s.model}`),
                cbnbEl("span", "cbnb-hint", s.auth ? "API key required" : "no API key"));
    const stats = cbnbEl("div", "cbnb-server-stats");
    const values = {};
    for (const [key, label, tip] of STATS) {
      const st = cbnbEl("span", "cbnb-stat");
      st.title = tip;
      st.dataset.stat = key;
      values[key] = cbnbEl("span", "cbnb-stat-value");
      st.append(values[key], cbnbEl("span", "cbnb-stat-label", label));
      stats.append(st);
    }
    card.append(head, stats);
    if (s.public) {
      card.append(cbnbEl("div", "cbnb-hint",
        `Listening on ${s.host}: other machines use this machine's address instead of 127.0.0.1.`));
    }
    card.append(snippetBox("curl", "curl", s.snippets.curl), snippetBox("openai (Python)", "openai", s.snippets.openai));
    return { card, values };
  };

  const draw = () => {
    const servers = model.get("servers") || [];
    empty.style.display = servers.length ? "none" : "";
    const seen = new Set();
    servers.forEach((s, i) => {
      seen.add(s.url);
      let c = cards.get(s.url);
      if (!c) { c = makeCard(s); cards.set(s.url, c); }
      for (const [key] of STATS) {
        const v = s.counters[key];
        const text = v === null || v === undefined ? "–" : key === "requests_per_s" ? cbnbFmt(v, 2) : String(v);
        if (c.values[key].textContent !== text) c.values[key].textContent = text;
      }
      if (list.children[i] !== c.card) list.insertBefore(c.card, list.children[i] || null);
    });
    for (const [url, c] of cards) {
      if (!seen.has(url)) { c.card.remove(); cards.delete(url); }
    }
    cbnbRecordRender(model, "server");
  };
  const schedule = cbnbOnFrame(draw);
  model.on("change:servers", schedule);
  draw();
  return () => { f.cleanup(); model.off("change:servers", schedule); };
}

export default { initialize, render };
