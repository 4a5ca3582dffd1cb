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
  const submit = () => {
    model.send({
      kind: "submit",
      prompt: prompt.value,
      max_new_tokens: mnt.value === "" ? null : Number(mnt.value),
      temperature: temp.value === "" ? null : Number(temp.value),
    });
  };
  btn.addEventListener("click", submit);
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
    model.off("change:prompt", onPrompt);
    model.off("change:max_new_tokens", onMnt);
    model.off("change:temperature", onTemp);
    model.off("change:workloads", fillWorkloads);
    model.off("change:chat_template", showHint);
  };
}

export default { render };
