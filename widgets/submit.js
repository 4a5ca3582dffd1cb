// Submit panel: prompt box, max_new_tokens, temperature, Submit; a standard workload with its scale.

function render({ model, el }) {
  const f = cbnbFrame(el, model, "cbnb-submit", "Submit");
  const prompt = cbnbEl("textarea", "cbnb-prompt");
  prompt.rows = 3;
  prompt.placeholder = "Ask the model something… (Ctrl+Enter submits)";
  prompt.value = model.get("prompt") || "";

  const num = (cls, label, value, attrs) => {
    const wrap = cbnbEl("label", "cbnb-field");
    wrap.append(cbnbEl("span", "cbnb-field-label", label));
    const input = cbnbEl("input", cls);
    input.type = "number";
    Object.assign(input, attrs);
    input.value = value;
    wrap.append(input);
    return [wrap, input];
  };
  const [mntWrap, mnt] = num("cbnb-max-new", "max_new_tokens", model.get("max_new_tokens"), { min: 1, step: 1 });
  const [tWrap, temp] = num("cbnb-temperature", "temperature", model.get("temperature"), { min: 0, max: 10, step: 0.1 });
  const btn = cbnbEl("button", "cbnb-btn cbnb-primary cbnb-submit-btn", "Submit");
  const row = cbnbEl("div", "cbnb-row");
  row.append(mntWrap, tWrap, btn);
  const hint = cbnbEl("div", "cbnb-hint");
  const showHint = () => {
    hint.textContent = (model.get("chat_template")
      ? "The model's chat template is applied to the prompt."
      : "The prompt is sent as plain text (no chat template).") + " Temperature 0 = greedy.";
  };
  showHint();

  const wlRow = cbnbEl("div", "cbnb-row");
  const wl = cbnbEl("select", "cbnb-workload");
  const fillWorkloads = () => {
    wl.replaceChildren(...(model.get("workloads") || []).map((w) => {
      const o = cbnbEl("option", null, w);
      o.value = w;
      return o;
    }));
    wl.value = model.get("workload");
  };
  fillWorkloads();
  const [scaleWrap, scale] = num("cbnb-scale", "scale", model.get("workload_scale"), { min: 0.05, max: 1, step: 0.05 });
  const wlBtn = cbnbEl("button", "cbnb-btn cbnb-workload-btn", "Run workload");
  const wlLabel = cbnbEl("label", "cbnb-field");
  wlLabel.append(cbnbEl("span", "cbnb-field-label", "standard workload"), wl);
  wlRow.append(wlLabel, scaleWrap, wlBtn);

  f.body.append(prompt, row, hint, wlRow);

  const sync = () => {
    model.set("prompt", prompt.value);
    model.save_changes();
  };
  prompt.addEventListener("input", sync);
  // One gesture, one submission: Submit is disabled from the click until Python confirms that gesture (its id,
  // "nonce", comes back), so the second click of a double click finds it disabled; Python also ignores a nonce it
  // has seen. If no answer comes (a dead kernel), the button comes back after IN_FLIGHT_MS.
  const IN_FLIGHT_MS = 10000;
  let inflight = null, inflightTimer = null;
  const done = () => {
    inflight = null;
    if (inflightTimer) clearTimeout(inflightTimer);
    inflightTimer = null;
    btn.disabled = false;
    btn.textContent = "Submit";
  };
  const submit = () => {
    if (inflight) return;
    inflight = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
    btn.disabled = true;
    btn.textContent = "Submitting…";
    inflightTimer = setTimeout(done, IN_FLIGHT_MS);
    model.send({
      kind: "submit",
      nonce: inflight,
      prompt: prompt.value,
      max_new_tokens: mnt.value === "" ? null : Number(mnt.value),
      temperature: temp.value === "" ? null : Number(temp.value),
    });
  };
  // detail > 1: the second (third...) click of a multi-click is part of the same gesture.
  btn.addEventListener("click", (e) => { if (!(e.detail > 1)) submit(); });
  const onMsg = (msg) => { if (msg && msg.kind === "submitted" && msg.nonce === inflight) done(); };
  model.on("msg:custom", onMsg);
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); submit(); }
  });
  wlBtn.addEventListener("click", () => {
    model.send({ kind: "workload", name: wl.value, scale: scale.value === "" ? null : Number(scale.value) });
  });

  const onPrompt = () => { if (document.activeElement !== prompt) prompt.value = model.get("prompt") || ""; };
  const onMnt = () => { mnt.value = model.get("max_new_tokens"); };
  const onTemp = () => { temp.value = model.get("temperature"); };
  model.on("change:prompt", onPrompt);
  model.on("change:max_new_tokens", onMnt);
  model.on("change:temperature", onTemp);
  model.on("change:workloads", fillWorkloads);
  model.on("change:chat_template", showHint);
  return () => {
    f.cleanup();
    if (inflightTimer) clearTimeout(inflightTimer);
    model.off("msg:custom", onMsg);
    model.off("change:prompt", onPrompt);
    model.off("change:max_new_tokens", onMnt);
    model.off("change:temperature", onTemp);
    model.off("change:workloads", fillWorkloads);
    model.off("change:chat_template", showHint);
  };
}

export default { render };
